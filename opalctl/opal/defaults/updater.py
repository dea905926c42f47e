"""The starting update rule: the user's own torch optimizer, exactly as it was handed over.

Until something here changes, a wrapped run is bit for bit the plain run: the same clipping, the same
optimizer step, the same scheduler step, in the same order.

The interface every updater keeps:
    build(params, previous, spec) -> an object with step(grads, update, ctx), state_dict(), load_state_dict(state)
                                     and optionally param_groups
    params   : dict parameter name -> torch parameter (update them in place, under torch.no_grad())
    previous : the updater this one replaces (None for the first); read previous.state_dict() to carry state over
    spec     : run facts: spec.optimizer (the user's torch optimizer, whose state persists across versions),
               spec.scheduler, spec.clip, spec.total_steps, spec.goal, spec.optimizer_state_by_name()
    grads    : dict parameter name -> gradient tensor (or None)
    update   : the index of this update (0 for the first)
    ctx      : ctx.progress (fraction of the budget used), ctx.loss (a tensor; reading it with .item() forces a
               device sync, so do not), ctx.log(**numbers) (recorded, not shown to you unless asked)
"""

import torch

# Settings an agent may change. With all of them at these values, this file is the plain optimizer.
LR_SCALE = 1.0       # multiplies every group's learning rate during the step (the optimizer's own lr is kept)
CLIP = None          # a max gradient norm applied before the step (on top of the user's), or None
ANNEAL_START = None  # a budget fraction after which the learning rate falls linearly to zero at the end, or None


def build(params, previous, spec):
    return Updater(params, previous, spec)


class Updater:
    def __init__(self, params, previous, spec):
        self.params = params
        self.optimizer = spec.optimizer
        self.scheduler = spec.scheduler
        self.clip = spec.clip

    def factor(self, progress):
        factor = LR_SCALE
        if ANNEAL_START is not None and progress > ANNEAL_START:
            factor = factor * max(0.0, (1.0 - progress) / (1.0 - ANNEAL_START))
        return factor

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, grads, update, ctx):
        parameters = list(self.params.values())
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(parameters, self.clip)
        if CLIP is not None:
            torch.nn.utils.clip_grad_norm_(parameters, CLIP)
        factor = self.factor(ctx.progress)
        if factor != 1.0:
            kept = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * factor
            self.optimizer.step()
            for group, lr in zip(self.optimizer.param_groups, kept):
                group["lr"] = lr
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self):
        # the optimizer's state (moments, step counts) lives in spec.optimizer and carries over by itself
        return {}

    def load_state_dict(self, state):
        pass
