"""The streaming runtime: asyncio scheduler (`scheduler`), staging (`stager`, with the
predictor's guesses), the host tier's one protocol (`host_reads`: mapped files in
`mapped_reads`, the pool's disk reads in `pool_reads`), the CUDA graphs decode steps replay
(`graph_choice`), the seed's failure modes for the sweep (`seed_baseline`), copy/compute
streams and events (`streams`), loop helpers (`aio`), runtime flags (`options`) and counters
(`stats`).

    opts = RuntimeOptions.from_args(args)            # flags from add_runtime_flags(parser)
    rt = StreamingRuntime(tree, model, opts, device=make_device(opts.device), batch=B)
    logits = rt.run(model.forward_steps(ids, cache), tokens=n)   # one coroutine per step
    rt.payload() / rt.write_stats(path); rt.close()

Submodules are imported lazily by callers (`streamrt.runtime.scheduler` pulls in the model's
checkpoint parser), so `import streamrt.runtime.options` stays light.
"""
