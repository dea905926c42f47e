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
    n = len(values)
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    numerator = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    denominator = sum((i - mean_x) ** 2 for i in range(n))
    return numerator / denominator if denominator else 0.0


def _roles(obs):
    """Per role: gradient norm, weight norm, update-to-weight ratio, and the cosine of gradient and momentum."""
    by_role = {}
    for name, param in obs["params"].items():
        by_role.setdefault(obs["roles"][name], []).append(name)
    rows = []
    for role in sorted(by_role):
        names = by_role[role]
        grad_sq, weight_sq, update_sq, dot, grad_m, mom_m = [], [], [], [], [], []
        for name in names:
            param = obs["params"][name].detach().float()
            before = obs["before"][name].float()
            grad = obs["grads"].get(name)
            weight_sq.append(param.pow(2).sum())
            update_sq.append((param - before).pow(2).sum())
            if grad is not None:
                grad = grad.detach().float()
                grad_sq.append(grad.pow(2).sum())
                state = obs["state"].get(name, {})
                momentum = state.get("exp_avg", state.get("momentum_buffer"))
                if momentum is not None:
                    momentum = momentum.detach().float()
                    dot.append((grad * momentum).sum())
                    grad_m.append(grad.pow(2).sum())
                    mom_m.append(momentum.pow(2).sum())
        rows.append((role, len(names), grad_sq, weight_sq, update_sq, dot, grad_m, mom_m))
    # one transfer for everything
    flat, layout = [], []
    for row in rows:
        layout.append([])
        for group in row[2:]:
            layout[-1].append(len(group))
            flat.extend(group)
    values = torch.stack(flat).tolist() if flat else []
    out, position = {}, 0
    for row, counts in zip(rows, layout):
        sums = []
        for count in counts:
            sums.append(sum(values[position:position + count]) if count else None)
            position += count
        grad_sq, weight_sq, update_sq, dot, grad_m, mom_m = sums
        weight = math.sqrt(weight_sq) if weight_sq is not None else None
        update = math.sqrt(update_sq) if update_sq is not None else None
        out[row[0]] = {
            "tensors": row[1],
            "grad_norm": math.sqrt(grad_sq) if grad_sq is not None else None,
            "weight_norm": weight,
            "update_to_weight": (update / weight) if weight else None,
            "grad_momentum_cosine": (dot / math.sqrt(grad_m * mom_m)) if dot is not None and grad_m and mom_m else None,
        }
    return out
