"""Executor 1: real tensors over ``torch.distributed`` with the gloo backend.

``Buffer`` (dispatch, combine, prefetch_weight, reduce_grad, invalidate_replicas) carries out the
Plans of the planner callable it is given (``moonep_sim.strategies.planner`` makes one; the
executor modules never import the strategies: the replay program above them,
``moonep_sim.experiments.ranks.replay_rank``, binds them); its parts are ``comm`` (groups, timed collectives, failure
naming), ``rows`` (the row engine) and ``pool`` (reused memory);
``moe.EPMoELayer`` is a reference MoE layer on it and ``moe.dense_moe`` the single-process layer
it must equal; ``launcher`` starts ranks (a rank program such as the replay on local ranks); ``liveness`` names a stopped or dead rank; ``teardown.shutdown`` ends a job in the safe
order (barrier, threads joined, groups destroyed) -- call it instead of ``dist.destroy_process_group``.
"""

from moonep_sim.gloo.buffer import Buffer
from moonep_sim.gloo.handle import Handle, build_handle
from moonep_sim.gloo.teardown import shutdown

__all__ = ["Buffer", "Handle", "build_handle", "shutdown"]
