"""The starting analysis: what the agent sees about training between its decisions.

Runs every EVERY updates, right after that update's step, and returns {"report": {...}} for the next decision,
or adds "wake": reason to ask for a decision now. Everything is measured on the device and read back with one
transfer per call, never one per update. The per-role figures (norms, update-to-weight ratios, cosines) are the
dearest part, a few device operations per tensor, and change slowly: they are measured on every ROLES_EVERY-th
call, and the report says at which update (roles_update).

    obs["update"]    updates done so far          obs["progress"]  fraction of the budget used
    obs["losses"]    losses since the last call   obs["lrs"]       effective learning rate of each group
    obs["params"]    name -> tensor, now          obs["before"]    name -> tensor, before this update's step
    obs["grads"]     name -> this update's gradient (or None)
    obs["state"]     name -> the optimizer's state for that tensor (e.g. exp_avg, momentum_buffer)
    obs["roles"]     name -> role (embedding, attention, mlp, matrix, head, norm, bias)
    memory           a dict kept between calls; keep only numbers, strings and lists in it
"""

import math

import torch

EVERY = 25
ROLES_EVERY = 4     # the per-role figures are measured on every 4th call (every 100 updates); the losses on each
WINDOW = 200        # losses kept for the slope and the spike test
SPIKE_FACTOR = 3.0  # a loss this many times the window's median is a spike


def analyze(obs, memory):
    losses = [float(x) for x in obs["losses"]]
    history = memory.setdefault("losses", [])
    history.extend(x for x in losses if math.isfinite(x))
    del history[:-WINDOW]
    report = {"update": obs["update"], "progress": round(obs["progress"], 4), "lrs": obs["lrs"]}
    finite = [x for x in losses if math.isfinite(x)]
    report["loss_window"] = {"mean": _mean(finite), "min": min(finite) if finite else None,
                             "max": max(finite) if finite else None, "count": len(losses),
                             "nonfinite": len(losses) - len(finite)}
    report["loss_slope_per_100"] = _slope(history) * 100 if len(history) >= 20 else None
    calls = memory.get("calls", 0)
    memory["calls"] = calls + 1
    if calls % ROLES_EVERY == 0 or "roles" not in memory:
        memory["roles"], memory["roles_update"] = _roles(obs), obs["update"]
    report["roles"], report["roles_update"] = memory["roles"], memory["roles_update"]
    wake = None
    if len(finite) < len(losses):
        wake = "non-finite loss"
    elif finite and len(history) >= 50:
        peak, floor = max(finite), min(history)
        # the median is at least the minimum: only a peak that passes the test against the minimum can pass it
        # against the median, so the sort is skipped on most calls
        if peak > SPIKE_FACTOR * floor and peak - floor > 0.5:
            median = sorted(history)[len(history) // 2]
            if peak > SPIKE_FACTOR * median and peak - median > 0.5:
                wake = f"loss spike: {peak:.4g} against a median of {median:.4g}"
    out = {"report": report}
    if wake is not None:
        out["wake"] = wake
    return out


def _mean(values):
    return sum(values) / len(values) if values else None


def _slope(values):
    """Least-squares slope per update, in one pass (sum of i*y against the closed forms of sum i and sum i^2)."""
    n = len(values)
    if n < 2:
        return 0.0
    sum_y = math.fsum(values)
    sum_iy = math.fsum(i * y for i, y in enumerate(values))
    mean_x = (n - 1) / 2
    numerator = sum_iy - mean_x * sum_y
    denominator = n * (n * n - 1) / 12
    return numerator / denominator


def _roles(obs):
    """Per role: gradient norm, weight norm, update-to-weight ratio, and the cosine of gradient and momentum.

    Two fused (foreach) operations (the updates, and gradient + momentum), one norm over every tensor at once
    and one transfer, whatever the number of tensors. (The call runs under no_grad: no detach is needed.)
    """
    names = list(obs["params"])
    params = [obs["params"][n] for n in names]
    updates = torch._foreach_sub(params, [obs["before"][n] for n in names])
    grads_by_name, states = obs["grads"], obs["state"]
    with_grad = [n for n in names if grads_by_name.get(n) is not None]
    grads = [grads_by_name[n] for n in with_grad]
    with_momentum, moments = [], []
    for n in with_grad:
        state = states.get(n, {})
        momentum = state.get("exp_avg", state.get("momentum_buffer"))
        if momentum is not None:
            with_momentum.append(n)
            moments.append(momentum)
    # |g + m|^2 = |g|^2 + |m|^2 + 2 g.m gives the dot product from three norms
    sums = list(torch._foreach_add([grads_by_name[n] for n in with_momentum], moments)) if moments else []
    values = torch.stack(torch._foreach_norm(params + list(updates) + grads + moments + sums)).tolist()
    count, with_count, m = len(names), len(with_grad), len(with_momentum)
    weight = dict(zip(names, values[:count]))
    update = dict(zip(names, values[count:2 * count]))
    grad = dict(zip(with_grad, values[2 * count:2 * count + with_count]))
    rest = values[2 * count + with_count:]
    cosine = {}
    for i, n in enumerate(with_momentum):
        g, mo, both = grad[n], rest[i], rest[m + i]
        cosine[n] = (both * both - g * g - mo * mo) / (2 * g * mo) if g > 0 and mo > 0 else None
    out = {}
    roles = obs["roles"]
    for role in sorted(set(roles.values())):
        members = [n for n in names if roles[n] == role]
        weight_norm = math.sqrt(sum(weight[n] ** 2 for n in members))
        update_norm = math.sqrt(sum(update[n] ** 2 for n in members))
        grads_here = [grad[n] for n in members if n in grad]
        cosines = [cosine[n] for n in members if cosine.get(n) is not None]
        out[role] = {
            "tensors": len(members),
            "grad_norm": math.sqrt(sum(x * x for x in grads_here)) if grads_here else None,
            "weight_norm": weight_norm,
            "update_to_weight": update_norm / weight_norm if weight_norm > 0 else None,
            "grad_momentum_cosine": sum(cosines) / len(cosines) if cosines else None,
        }
    return out
