"""Tensor parallelism inside one worker (Megatron-style), N ranks over torch.distributed.

    shard.py   which heads, columns and vocabulary rows a rank holds (arithmetic only)
    group.py   a rank's collectives: all-reduce, plan broadcast, logits gather; timed
    plan.py    a step's plan, broadcast by rank 0 so that every rank runs the same forward
    launch.py  rank 0's side: start ranks 1..N-1 as processes, wait, watch, stop
    rank.py    the main of ranks 1..N-1: a shard of the model and KV cache, a step loop

Rank 0 is the engine (scheduler, block pool, sampler); the others only run forwards.
"""
