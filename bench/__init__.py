"""meshgate's benchmark suite (issue #7): ``python -m bench`` (or ``make bench``).

Every figure is measured side by side with a baseline in the same run, and reported
first as a ratio against that baseline; absolute figures are context only:

1. Register throughput against a bare grpc.aio echo service (same message sizes, same
   client harness, same concurrency): the "physical limit" of the machine.
2. Time to a verified world for N simulated workers (Register, verify, AwaitWorld).
3. meshgate against torch.distributed.elastic's own c10d dynamic rendezvous.
4. How the cost per worker grows with N (from 2).

Modules: ``common`` (plans, ids, /proc readings), ``servers`` (the coordinator and echo
server processes), ``load`` (the multi-process grpc.aio load generator), ``c10d`` (the
torch baseline), ``profile`` (py-spy / pyinstrument summaries), ``report`` (the table).
"""
