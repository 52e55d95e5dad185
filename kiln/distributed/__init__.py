"""Running one model over several processes: the world (process groups from a launcher's
environment, or spawned locally), the collectives layers call explicitly in ``forward``, and
the point-to-point messages of the runtime (rank 0's steps, activations between pipeline
stages, sampled tokens: ``kiln.distributed.comm``).

Imports flow one way: layers call ``kiln.distributed``; it imports nothing of kiln's models.
"""
from kiln.distributed.comm import all_gather, all_reduce, world_min
from kiln.distributed.world import World, init_world, launch_env, shutdown_world, world

__all__ = ["World", "all_gather", "all_reduce", "init_world", "launch_env", "shutdown_world", "world", "world_min"]
