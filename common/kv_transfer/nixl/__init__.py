"""The NIXL connector: KV transfer between a prefill (P) and a decode (D) worker, pull or push.

P (`do_remote_decode`): the request prefills and samples its first token as usual; when it
finishes, its blocks go under a lease instead of back to the pool, and its output carries
`kv_transfer_params` saying where they are (`RemotePrefill`).

D (`do_remote_prefill`): on admission the request counts every prompt token it lacks as computed
elsewhere, so it is scheduled for a single token (the one after the prompt, or the last prompt
token when no first token came along). Its blocks are allocated, its own prefix hits skipped;
`start_load_kv` issues one NIXL READ of every layer for the rest (its blocks' runs, not blocks,
are the descriptors: docs/design.md), and the forward's decorator waits for it just before the
first layer's attention and checks each layer's checksums before that layer's. After the forward
D tells P to release the lease. A read that fails or passes `load_timeout` marks the request
failed: the engine drops its token and recomputes it locally or fails it, by policy.

Push (layer-wise): D first reserves blocks (`reserve`); P, given the reservation as `push_to`,
WRITEs each layer's blocks from `save_kv_layer` — right after that layer's attention, while the
next layer computes. Each prefill step sends one chunk (the blocks that became full, all of them
in the last step); every chunk's WRITE of every layer carries a notification, and D admits the
request only once every chunk of every layer has landed (see reservations.py). P's step never
waits for its writes: the request's output waits (`is_sending`), and P answers with the
reservation only when every write landed, with an error otherwise.

Fail closed: blocks that a transfer reads or writes stay referenced until the transfer settles
(`TransferHolds`), so a failed, aborted or finished request never lets a late READ land in, or
a late WRITE read from, blocks that another request owns by then.

Layout: `NixlConnector` (connector.py) is the `KVConnector`, a façade over the scheduler half
(scheduler.py: leases.py for P's leases, reservations.py for D's, push.py for P's push books)
and the worker half (worker.py: the transport, the KV tensors, the step's transfers; holds.py
keeps the blocks under transfer, staging.py the buffers between head splits, checksum.py the
per-block sums); stats.py holds the running totals both halves add to. transport.py is the
`Transport` (common/kv_transfer/transport.py) over NIXL: one agent (agent.py), a transfer thread
carrying each transfer as a job (job.py), and UCX's report of what carries each peer's KV
(transport_info.py).
"""

from common.kv_transfer.nixl.connector import NixlConnector

__all__ = ["NixlConnector"]
