"""``pairs.py``'s bf16 extras: the micro-batch budget sweep (``--budgets``), the kernel A/B (``--ab``) and the
per-call profiles (``--profile``). Run through ``benchmarks/pairs.py``, which imports this module when asked."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from pairs import Workload, measure, requests_of, time_call
from rerankit.engine import EmbeddedBackend
from rerankit.engine.plan import RequestParts, plan_requests


def budget_sweep(workload: Workload, backend: EmbeddedBackend, budgets: list[int], queries: int,
                 results: list[dict]) -> None:
    """Ours (MIS) at several micro-batch budgets (the choice of DEFAULT_MAX_BATCH_TOKENS); the warm-up call
    captures the CUDA graphs of the new shapes."""
    default = backend.max_batch_tokens
    for budget in budgets:
        backend.max_batch_tokens = budget
        for variant, multi_item in (("rerankit-mis", True),):
            batch = requests_of(workload, multi_item, queries)
            pairs = sum(len(request.items) for request in batch)
            times, peak = measure(lambda: backend.score_batch(batch), 5 if len(batch) == 1 else 2, 1)
            row = {"workload": f"{workload.name}x{len(batch)}", "variant": variant, "budget": budget,
                   "pairs_per_s": pairs / statistics.median(times), "peak_gib": peak}
            results.append(row)
            print(json.dumps(row), flush=True)
    backend.max_batch_tokens = default


KERNEL_KINDS = (("attention", ("prefix_attention",)), ("label head", ("label_logprobs", "vocab_partial")),
                ("swiglu gemm", ("swiglu",)), ("q/k/v gemm", ("qkv",)), ("fp8 quantization", ("quantize",)),
                ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma")), ("copy", ("memcpy", "memset")),
                ("fused elementwise (compiled)", ("triton_",)))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in lowered for mark in marks)), "other")


def idle_split(events) -> dict:
    """Where the GPU sat idle during the profiled call: before its first kernel (host: encode, plan, first
    launches), between kernels (launch gaps, host syncs) and after the last (copies back, building the response)."""
    call = next((event for event in events if event.name == "rerankit_call"), None)
    kernels = sorted((event.time_range.start, event.time_range.end) for event in events
                     if event.device_type == torch.autograd.DeviceType.CUDA and event.name != "rerankit_call")
    if call is None or not kernels:
        return {}
    gaps, busy_end = 0.0, kernels[0][0]
    for start, end in kernels:
        gaps += max(start - busy_end, 0.0)
        busy_end = max(busy_end, end)
    return {"before_first_kernel": (kernels[0][0] - call.time_range.start) / 1000, "between_kernels": gaps / 1000,
            "after_last_kernel": (call.time_range.end - busy_end) / 1000}


def profile_call(workload: Workload, backend: EmbeddedBackend, folder: Path, results: list[dict],
                 tag: str = "") -> None:
    """Where one call's time goes: host time of each engine phase, GPU time by kernel kind, a profiler table
    (``profile_<workload><tag>.txt`` in ``folder``)."""
    from torch.profiler import ProfilerActivity, profile

    requests = requests_of(workload, True)
    loaded = backend._model()
    phases: dict = {}
    begun = time.perf_counter()
    prepared = [backend._prepare(request, loaded, position) for position, request in enumerate(requests)]
    phases["encode_ms"] = 1000 * (time.perf_counter() - begun)
    begun = time.perf_counter()
    parts = [RequestParts.from_encoded(entry.encoded, share_prefix=backend._shares_prefix(entry.request, entry.encoded))
             for entry in prepared]
    micro = list(plan_requests(parts, backend.max_batch_tokens, padded=False, causal=True,
                               pin_memory=backend._runner.pin_memory))
    phases["plan_ms"] = 1000 * (time.perf_counter() - begun)
    phases["micro_batches"] = len(micro)
    times = time_call(lambda: backend.score_batch(requests), 5)
    phases["call_ms"] = 1000 * statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("rerankit_call"):
            backend.score_batch(requests)
        torch.cuda.synchronize()
    phases["gpu_idle_split_ms"] = idle_split(prof.events())
    events = prof.key_averages()
    kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA
               and event.key != "rerankit_call"]  # the call's annotation shows on the GPU timeline too
    phases["gpu_kernel_ms"] = sum(event.self_device_time_total for event in kernels) / 1000
    phases["gpu_idle_ms"] = phases["call_ms"] - phases["gpu_kernel_ms"]
    by_kind: dict[str, float] = {}
    for event in kernels:
        kind = kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_device_time_total / 1000
    phases["gpu_ms_by_kind"] = by_kind
    table = events.table(sort_by="self_device_time_total", row_limit=30)
    host = events.table(sort_by="self_cpu_time_total", row_limit=20)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile_{workload.name}{tag}.txt").write_text(
        json.dumps(phases, indent=1) + "\n\n" + table + "\n\nby host time:\n" + host)
    results.append({"workload": workload.name + tag, "profile": phases})
    print(json.dumps({"workload": workload.name + tag, "profile": phases}), flush=True)


def kernel_ab(workloads: list[Workload], backend: EmbeddedBackend, results: list[dict]) -> None:
    """W1, W3 and LI call times in one process: the fused q/k kernel on/off and each attention tiling (eager), with
    and without CUDA graphs and the ramp-up, then the unfused residual projections and the fused SwiGLU GEMM."""
    from rerankit.engine.runner import graphed_forward
    from rerankit.kernels.attention_config import CONFIG_ENV

    runner = backend._runner
    model = runner.model
    fused, min_tokens = model.fused_qk, model.fused_qk_min_tokens
    graphs, ramp = runner.graphs, backend._ramp
    runner.graphs = None  # eager launches: a captured graph would keep the kernels it was captured with
    model.fused_qk_min_tokens = 0  # fused or not at every batch size
    for fused_qk in (True, False):
        for name, spec in (("default", ""),
                           ("gqa-64x32-w4-pointers", "block_m=64,block_n=32,num_warps=4,num_stages=3,tma=0,maxnreg=0"),
                           ("per-head-128x32-w4-pointers",
                            "pack_gqa=0,block_m=128,block_n=32,num_warps=4,num_stages=3,tma=0,maxnreg=0")):
            model.fused_qk = fused_qk
            os.environ[CONFIG_ENV] = spec
            ab_row({"workload": "kernel-ab", "fused_qk": fused_qk, "attention": name, "cuda_graphs": False},
                   workloads, backend, results)
    model.fused_qk, model.fused_qk_min_tokens = fused, min_tokens
    os.environ.pop(CONFIG_ENV, None)
    # With the default kernels again: eager launches against CUDA-graph replays (EmbeddedBackend's cuda_graphs=True),
    # each with and without the ramp-up chunk (the first 16 items of a call as a micro-batch of their own).
    for graphed, ramped in ((False, False), (False, True), (True, False), (True, True)):
        runner.graphs = graphed_forward(model, runner.device) if graphed else None
        backend._ramp = ramped
        ab_row({"workload": "kernel-ab", "cuda_graphs": graphed, "ramp": ramped, "fused_qk": "auto",
                "attention": "default"}, workloads, backend, results)
    runner.graphs, backend._ramp = graphs, ramp
    # The residual projections behind an op Inductor cannot fuse into addmm (no copy of the residual), and the
    # gate/up GEMM with SwiGLU in its epilogue (Triton) against cuBLAS + Inductor's activation. Each setting gets
    # graphs of its own (a graph keeps the steps it was captured with), as the backend's defaults run them.
    for name in ("unfused_residual", "fused_swiglu"):
        default = getattr(model, name)
        for flag in (False, True):
            setattr(model, name, flag)
            runner.graphs = graphed_forward(model, runner.device) if graphs is not None else None
            ab_row({"workload": "kernel-ab", name: flag, "cuda_graphs": runner.graphs is not None}, workloads,
                   backend, results)
        setattr(model, name, default)
    runner.graphs = graphs


AB_WORKLOADS = ("W1", "W3", "LI")


def ab_row(row: dict, workloads: list[Workload], backend: EmbeddedBackend, results: list[dict]) -> None:
    """``row`` with the median W1 and LI calls and the W3 p50/p99 under the backend's current settings."""
    for workload in workloads:
        if workload.name in AB_WORKLOADS:
            batch = requests_of(workload, True)
            times, _ = measure(lambda: backend.score_batch(batch), 30 if workload.latency else 5, 2)
            row[f"{workload.name}_ms_p50"] = 1000 * statistics.median(times)
            if workload.latency:
                row[f"{workload.name}_ms_p99"] = 1000 * sorted(times)[int(0.99 * (len(times) - 1))]
    results.append(row)
    print(json.dumps(row), flush=True)


def bf16_extras(args, workloads: list[Workload], backend: EmbeddedBackend, results: list[dict]) -> None:
    """The bf16 engine's budget sweep, kernel A/B and profiles, where asked."""
    if args.budgets:
        budgets = [int(budget) for budget in args.budgets.split(",")]
        for workload in workloads:
            if workload.name in ("W1", "W2", "LI"):
                budget_sweep(workload, backend, budgets, args.sweep_queries, results)
    if args.ab:
        kernel_ab(workloads, backend, results)
    if args.profile:
        for workload in workloads:
            if workload.name in AB_WORKLOADS:
                profile_call(workload, backend, Path(args.profile), results)
