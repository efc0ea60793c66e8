"""Tensor parallelism over torch.distributed: the rank's place in the group, sharded layers, worker processes.

Rank 0 runs the scheduler, the block manager and the sampler (:mod:`iterserve.engine`) and broadcasts each
step's model inputs (:mod:`.executor`); the other ranks only run the forward pass on them (:mod:`.worker`).
"""
