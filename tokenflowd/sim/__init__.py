"""Discrete-event simulator: a virtual clock and a cost model driving the real scheduler and policies.

    workload.py    requests as plain data (arrivals, lengths, reading rates, Mooncake replay)
    cost.py        CostModel: step time (roofline), KV pool size, host-link time; presets
    executor.py    CostModelExecutor: the engine's Executor seam, without tensors
    simulator.py   the event loop and per-request records
    result.py      summary (buffer.qos keys), JSON document, comparison table
    scenarios.py   TokenFlow Fig. 6 and Table 1 setups
    run.py         run_simulation(scenario, policy) -> (result, document)
    calibrate.py   fit a CostModel to our engine's measured steps
    cli.py         `tokenflowd sim` and `tokenflowd calibrate`
"""
