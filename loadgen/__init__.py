"""The bundled burst load generator: bursts of streaming clients that read at human speed.

    workload.py   the seeded workload (tokenflowd.sim.workload, BurstGPT CSV replay, burst patterns) as HTTP bodies
    client.py     asyncio + aiohttp readers: one SSE stream each, token arrival times, timeout, abandon
    report.py     the summary (tokenflowd.buffer.qos plus SLO, ITL, outcomes), per-request records, the table
    plots.py      timelines.png, buffer.png, ttft_cdf.png (matplotlib, Agg)
    compare.py    one seeded workload against two endpoints, B/A ratios
    cli.py        `tokenflowd-loadgen run|compare` (`python -m loadgen`)
"""
