"""The starting analysis: what the agent sees about training between its decisions.

Runs every EVERY updates, right after that update's step, and returns {"report": {...}} for the next decision,
or adds "wake": reason to ask for a decision now. Everything is measured on the device and read back with one
transfer per call, never one per update.

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
    report["roles"] = _roles(obs)
    wake = None
    if len(finite) < len(losses):
        wake = "non-finite loss"
    elif finite and len(history) >= 50:
        median = sorted(history)[len(history) // 2]
        if max(finite) > SPIKE_FACTOR * median and max(finite) - median > 0.5:
            wake = f"loss spike: {max(finite):.4g} against a median of {median:.4g}"
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

    A handful of fused (foreach) operations over all tensors and one transfer, whatever the number of tensors.
    """
    names = list(obs["params"])
    params = [obs["params"][n].detach() for n in names]
    updates = torch._foreach_sub(params, [obs["before"][n] for n in names])
    weight_norms = torch._foreach_norm(params)
    update_norms = torch._foreach_norm(updates)
    with_grad = [n for n in names if obs["grads"].get(n) is not None]
    grads = [obs["grads"][n].detach() for n in with_grad]
    grad_norms = torch._foreach_norm(grads) if grads else []
    with_momentum, moments = [], []
    for n in with_grad:
        state = obs["state"].get(n, {})
        momentum = state.get("exp_avg", state.get("momentum_buffer"))
        if momentum is not None:
            with_momentum.append(n)
            moments.append(momentum.detach())
    pairs = []
    if moments:
        paired_grads = [obs["grads"][n].detach() for n in with_momentum]
        # |g + m|^2 = |g|^2 + |m|^2 + 2 g.m gives the dot product from three norms
        sum_norms = torch._foreach_norm(torch._foreach_add(paired_grads, moments))
        pairs = [torch._foreach_norm(paired_grads), torch._foreach_norm(moments), sum_norms]
    flat = list(weight_norms) + list(update_norms) + list(grad_norms) + [x for group in pairs for x in group]
    values = torch.stack([x.float() for x in flat]).tolist() if flat else []
    count = len(names)
    weight = dict(zip(names, values[:count]))
    update = dict(zip(names, values[count:2 * count]))
    grad = dict(zip(with_grad, values[2 * count:2 * count + len(with_grad)]))
    rest = values[2 * count + len(with_grad):]
    m = len(with_momentum)
    cosine = {}
    for i, n in enumerate(with_momentum):
        g, mo, both = rest[i], rest[m + i], rest[2 * m + i]
        cosine[n] = (both * both - g * g - mo * mo) / (2 * g * mo) if g > 0 and mo > 0 else None
    out = {}
    for role in sorted(set(obs["roles"].values())):
        members = [n for n in names if obs["roles"][n] == role]
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
