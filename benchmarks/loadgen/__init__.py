"""``gaggle bench``: a load generator for any OpenAI-compatible endpoint, with the method and metrics of
``vllm bench serve`` (TTFT, TPOT, ITL, E2E; Poisson/gamma arrivals; max concurrency), and ``--engine-only``:
the same workload through the engine in this process, the reference for "served / engine-only".

    dataset.py     the prompts (random token ids or a JSONL file) and the arrival schedule
    http.py        a lean HTTP/1.1 client over asyncio streams (keep-alive, chunked bodies)
    client.py      one request (SSE parsed by hand), one client process, the processes together
    engine_only.py the same workload through ``LLMEngine.step()``
    metrics.py     per-request records → the numbers, the table, the saved JSON, the ratio
    cli.py         the flags and the command (``cli/main.py`` registers it as ``gaggle bench``)
    breakdown.py   a served run's TTFT split part by part from the API's and the workers' logs
    batch_bench.py the Batch API on a big batch, beside a trickle of streaming requests
    scale_load.py  the stand-ins for API processes that ``benchmarks/scale.py`` drives Redis with
"""
