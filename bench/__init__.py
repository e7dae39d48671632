"""meshgate's benchmark suite (issue #7): ``python -m bench`` (or ``make bench``).

Every figure is measured side by side with a baseline in the same run, and reported
first as a ratio against that baseline; absolute figures are context only:

1. Register throughput against a bare grpc.aio echo service (same message sizes, same
   client harness, same concurrency): the "physical limit" of the machine.
2. Time to a verified world for N simulated workers (Register, verify, AwaitWorld).
3. meshgate against torch.distributed.elastic's own c10d dynamic rendezvous.
4. How the cost per worker grows with N (from 2).
5. Time to a verified world through agent fan-in (RegisterBatch), next to 2.
6. Jobs; 7. torchrun on meshgate's backend against c10d.
8. Recovery: a node of a running job dies (a spare, the pool); beside it the same failure
   on real torchrun processes (c10d, ``--nnodes=N:N+1``) and on real agents.

Each section runs per variant of the coordinator under test: memory+plaintext and
sqlite+mtls (the daemon's defaults), side by side.

Modules: ``common`` (plans, ids, /proc readings), ``variants`` (store + transport, the
coordinator.toml and dev CA of each server), ``servers`` (the coordinator and echo
server processes), ``load`` (the multi-process grpc.aio load generator), ``fanin`` (the
daemon driven by simulated agents), ``c10d`` (the torch baseline), ``recovery`` and
``recovery_torchrun`` (section 8), ``profile`` (py-spy /
pyinstrument summaries), ``report`` (the table).
"""
