"""The planner: predict a run's peak memory on fake tensors (estimate), bound it in closed form, rank the
switch combinations that fit a budget by a cost model (plan, cost, report), and check a run before it starts
(preflight). It depends only downward: on :mod:`memfit.build`, :mod:`memfit.step` and the layers below."""
