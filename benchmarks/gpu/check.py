"""The GPU check: what a lent device runs first, in at most 8 minutes on one H100 or H200.

    HF_ACTQ_COMMIT=<commit> bash benchmarks/gpu/check.sh  # every part, results under $OUT
    python benchmarks/gpu/check.py kernels --out DIR        # one part (tests, kernels, steps)
    python benchmarks/gpu/check.py report --out DIR         # summary.md from the parts' JSON
    python benchmarks/gpu/check.py all --dry-run --out DIR  # the same code on CPU, tiny shapes

A lent device gets a copy of the working tree without its .git: ``HF_ACTQ_COMMIT`` (the output
of ``git rev-parse --short HEAD`` here, written into the command sent) names the commit that
every results file records.

Parts, each under its own time budget (the rows finished when it runs out are kept):
- ``tests``: the kernel, codec, few-bit and op tests with ``HF_ACTQ_TEST_DEVICE=cuda`` (every
  kernel variant and dtype against its twin) and ``tests/test_cuda.py``'s patched tiny LLaMA and
  BERT steps, CUDA against CPU; summarised per test file, failures named.
- ``kernels``: each Triton kernel against its PyTorch twin on the same tensors (bit-identical or
  the largest difference) and timed against the op it replaces or accompanies: few-bit GELU/SiLU
  forward+backward against torch's, codec pack+unpack against two copies of the tensor, the
  norm backward against torch's LayerNorm, the packed-input SDPA recompute against stock SDPA;
  fp32, bf16 and fp16.
- ``steps``: training-step time of every recipe against the unpatched model, interleaved in one
  process, and the allocator's step peak: MiniLM shapes (batch 32, seq 128, fp32 and bf16
  autocast) and a LLaMA2-7B-shaped two-layer slice with LoRA (bf16, micro-batch 4, seq 2048),
  stock activation checkpointing beside "checkpoint".

Every part writes ``<part>.json`` (rows, and the device, driver, torch and Triton versions) and
``<part>.md``. Kernel and step rows give "host ms" too, the host's time per call from an idle
device (close to the device's time: the launches bound it, or a hidden synchronisation), and
``profile-*.txt`` (in the archive) holds torch.profiler's tables of each kernel case and of each
recipe's step on the first model. ``--dry-run`` runs on CPU with tiny shapes and the Triton kernels under the
interpreter, so that the default test suite keeps this script working between loans. Weights are
random: nothing here needs pretrained ones.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tests", "kernels", "steps")
# Seconds per part on a GPU: 7.5 minutes in all, leaving room for the start-up in 8.
BUDGETS = {"tests": 180, "kernels": 80, "steps": 140}
# Label -> (recipe, overrides); "stock-checkpointing" is the unpatched model under transformers'
# own checkpointing, what "checkpoint" costs before its packing.
RECIPES = {
    "baseline": None,
    "fewbit": ("fewbit", {}),
    "uniform-4": ("uniform", {"bits": 4}),
    "alam-1-even": ("alam", {"bits": 1, "adaptive": False}),
    "checkpoint": ("checkpoint", {}),
    "stock-checkpointing": None,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Environment and output ---------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # CPU, tiny shapes, the kernels under the interpreter: the code ran, the numbers mean
        # nothing.
        "dry_run": device.type != "cuda",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            info["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        except OSError:
            info["driver"] = None
    return info


@functools.cache
def _commit() -> str | None:
    """The commit, for tools/results_age.py (the device's copy has no .git: HF_ACTQ_COMMIT);
    read once, not at every row's write."""
    from hf_actq.report.provenance import checkout_commit

    return checkout_commit(ROOT)


def write(out: Path, part: str, rows: list, env: dict, note: str = "") -> None:
    """``<part>.json`` and ``<part>.md``, rewritten after every row (a part stopped by its budget
    keeps what it finished)."""
    from hf_actq.kernels.registry import FAILED

    out.mkdir(parents=True, exist_ok=True)
    data = {"part": part, "commit": _commit(), "environment": env, "rows": rows, "note": note}
    # Kernels that failed in this process and ran their twins instead: a timing or comparison
    # after the failure measured the twin.
    data["kernels that fell back"] = dict(FAILED)
    (out / f"{part}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{part}.md").write_text(markdown(part, data))


def markdown(part: str, data: dict) -> str:
    env = data["environment"]
    lines = [
        f"# GPU check: {part}",
        "",
        f"{env['device']}; driver {env.get('driver')}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"Triton {env['triton']}; {env['date']}; commit {data.get('commit')}.",
        "",
    ]
    if env.get("dry_run"):
        lines += ["Dry run (CPU, tiny shapes, kernels under the interpreter): no figure here means "
                  "anything.", ""]  # fmt: skip
    rows = data["rows"]
    if rows:
        columns = list(rows[0])
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


# Part 1: the CUDA test subset ----------------------------------------------------------------
def run_tests(
    out: Path, device: torch.device, dry: bool, deadline: float, rerun: Path | None = None
) -> list:
    """``rerun``: a ``tests-<n>.jsonl`` of an earlier check; the kernel selection then runs only
    the tests that did not pass there (failed, or not reached before its budget ran out)."""
    if dry:
        selections = [
            ("kernel fallback", {}, ["tests/kernels/test_fallback.py", "-k", "every_launcher"])
        ]
    else:
        on_gpu = ["tests/kernels", "tests/codecs", "tests/fewbit", "tests/ops"]
        on_gpu += ["-k", "not every_kernel_compiles"]  # the AOT compile needs no GPU
        cuda_env = {"HF_ACTQ_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
        if rerun is not None:
            on_gpu = _not_passed(on_gpu, cuda_env, rerun)
        # The training steps first: a dozen tests, where the kernel selection (a thousand, each
        # kernel compiled on first use) ran out of its budget on the first lent H200.
        selections = [
            (
                "training steps, CUDA against CPU",
                {},
                # test_cuda's first test reruns the selection below
                ["tests/test_cuda.py", "-m", "cuda", "-k", "not compiled_on_the_gpu"],
            ),
            ("kernels, codecs, few-bit, ops on the GPU", cuda_env, on_gpu),
        ]
    env_info, rows = environment(device), []
    for name, extra_env, arguments in selections:
        lines_path = out / f"tests-{len(rows)}.jsonl"
        lines_path.unlink(missing_ok=True)
        env = dict(os.environ, **extra_env, HF_ACTQ_TEST_LINES=str(lines_path))
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        if extra_env.get("HF_ACTQ_TEST_DEVICE") == "cuda":
            env.pop("TRITON_INTERPRET", None)
        if not arguments:  # a rerun with nothing left to run
            continue
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "pytest_lines", *arguments]
        timed_out, status, tail = False, None, ""
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=max(5.0, deadline - time.monotonic()),
            )  # fmt: skip
            status, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            timed_out = True
        results = [json.loads(line) for line in _read_lines(lines_path)]
        counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed")}
        counts["skipped"] = sum(r["outcome"] == "skipped" for r in results)
        # The first and last lines of each failure (tests-<n>.jsonl in the archive has more)
        failures = [
            f"{r['test']}: {' / '.join(dict.fromkeys(_ends(r['message'])))[:400]}"
            for r in results
            if r["outcome"] == "failed"
        ]
        rows.append(
            {
                "selection": name,
                **counts,
                "stopped by the budget": timed_out,
                "exit status": status,
                "failures": "; ".join(failures[:40]) + (" ..." if len(failures) > 40 else ""),
            }
        )
        (out / f"tests-{len(rows) - 1}.log").write_text(tail)
        write(out, "tests", rows, env_info)
    return rows


def _not_passed(arguments: list[str], env: dict, earlier: Path) -> list[str]:
    """The ids ``pytest arguments`` collects that did not pass in ``earlier``'s lines."""
    passed = {
        line["test"]
        for line in map(json.loads, _read_lines(earlier))
        if line["outcome"] in ("passed", "skipped")
    }
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", *arguments]
    listed = subprocess.run(
        command, cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True
    ).stdout.splitlines()
    return [test for test in listed if "::" in test and test not in passed]


def _ends(message: str) -> list[str]:
    lines = message.splitlines() or [""]
    return [lines[0], lines[-1]]


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# Part 2: kernels against their twins and the ops they replace --------------------------------
def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _host_timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds the host spends in ``fn()`` from an idle device: the launches' Python and
    dispatch cost, plus any wait for the device (a hidden synchronisation). Beside the device
    time it says whether a case is bound by the host or the device."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def _profile(fn, device: torch.device, path: Path, calls: int = 3) -> None:
    """torch.profiler's table of ``calls`` calls of ``fn``, by self host time and by self device
    time, to ``path``: where a slow case spends its time, for the session after the loan."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
    except Exception as error:  # noqa: BLE001 (a profiler that cannot start must not end the part)
        path.write_text(f"the profiler failed: {type(error).__name__}: {error}\n")
        return
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        tables.append(events.table(sort_by="self_cuda_time_total", row_limit=25))
    path.write_text(f"{calls} calls\n\n" + "\n\n".join(tables))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


class _Twins:
    """``with _Twins(): ...`` runs the PyTorch twins wherever the kernels would run."""

    def __enter__(self):
        self.before = os.environ.get("HF_ACTQ_DISABLE_TRITON")
        os.environ["HF_ACTQ_DISABLE_TRITON"] = "1"

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("HF_ACTQ_DISABLE_TRITON", None)
        else:
            os.environ["HF_ACTQ_DISABLE_TRITON"] = self.before


def _difference(a, b) -> float:
    """The largest absolute difference of two tensors or tuples of tensors (0: bit-identical;
    nan where they differ in shape, dtype or NaN pattern)."""
    pairs = zip(a, b, strict=True) if isinstance(a, (tuple, list)) else [(a, b)]
    worst = 0.0
    for x, y in pairs:
        if x is None or y is None:
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("nan")
        if torch.equal(x, y):
            continue
        if not torch.equal(torch.isnan(x), torch.isnan(y)):
            return float("nan")
        worst = max(worst, float((x.double() - y.double()).abs().nan_to_num().max()))
    return worst


def timed_codecs(stochastic: bool) -> dict:
    """The codecs the kernel parts time, by label (``speed.py`` times them as training packs,
    stochastic)."""
    from hf_actq.codecs import (
        AverageQuantCodec,
        MaskCodec,
        RotatedSampleCodec,
        SignPreservingCodec,
        SmaQCodec,
    )

    return {
        "uniform 4-bit": AverageQuantCodec(4, 1, stochastic=stochastic),
        "AQ 0.5-bit (2-bit, groups of 4)": AverageQuantCodec(2, 4, stochastic=stochastic),
        "BLPA 4-bit": SignPreservingCodec(4),
        "SmaQ": SmaQCodec(stochastic=stochastic),
        "rotated 4-bit": RotatedSampleCodec(bits=4, group_size=1, stochastic=stochastic),
        "mask 1-bit": MaskCodec(),
    }


def kernel_cases(device: torch.device, dtype: torch.dtype, dry: bool) -> list:
    """``(name, hf_actq function, the function it is timed against, goal ratio or None)``; the
    hf_actq function returns the tensors compared between kernel and twin. Goals (issue 38):
    few-bit forward+backward at most 1.1x torch's, pack+unpack at most two copies."""
    from torch import nn

    from hf_actq.codecs import (
        AverageQuantCodec,
        MaskCodec,
    )
    from hf_actq.ops import FewBitActivation
    from hf_actq.ops.attention import compressed_sdpa_attention
    from hf_actq.ops.dedup import PackCache
    from hf_actq.ops.norm import CompressedLayerNorm

    generator = torch.Generator(device="cpu").manual_seed(0)
    rows, width = (8, 64) if dry else (4096, 4096)  # 16 Mi elements: 64 MiB in fp32
    x = torch.randn(rows, width, generator=generator).to(device=device, dtype=dtype)
    grad = torch.randn(rows, width, generator=generator).to(device=device, dtype=dtype)
    cases = []

    def activation_case(name, torch_fn):
        op = FewBitActivation(name, bits=3)

        def ours():
            leaf = x.detach().requires_grad_()
            y = op(leaf)
            y.backward(grad)
            return y, leaf.grad

        def stock():
            leaf = x.detach().requires_grad_()
            torch_fn(leaf).backward(grad)

        cases.append((f"few-bit {name} 3-bit fwd+bwd vs torch", ours, stock, 1.1))

    activation_case("gelu", nn.functional.gelu)
    activation_case("silu", nn.functional.silu)

    def two_copies():
        x.clone()
        x.clone()

    # Deterministic rounding, so that kernel and twin can be compared bit for bit (stochastic
    # rounding draws other noise in each; the test suite checks its statistics).
    for label, codec in timed_codecs(stochastic=False).items():
        source = (x > 0).to(dtype) if isinstance(codec, MaskCodec) else x

        def ours(codec=codec, source=source):
            packed = codec.pack(source, 1234 if codec.uses_rng else None)
            return (*packed.tensors, codec.unpack(packed))

        cases.append((f"{label} pack+unpack vs 2 copies", ours, two_copies, 1.0))

    tokens, hidden = (16, 64) if dry else (32 * 128, 768)
    norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
    deterministic = AverageQuantCodec(4, 1, stochastic=False)
    compressed = CompressedLayerNorm(norm, deterministic, PackCache())
    h = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    g = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype)

    def norm_run(module):
        leaf = h.detach().requires_grad_()
        norm.weight.grad = None
        torch.manual_seed(0)
        module(leaf).backward(g)
        return leaf.grad, norm.weight.grad

    cases.append(
        (
            "LayerNorm 4-bit fwd+bwd vs torch",
            lambda: norm_run(compressed),
            lambda: norm_run(norm),
            None,
        )
    )

    batch, heads, seq, dim = (1, 2, 16, 16) if dry else (4, 32, 2048, 128)
    q, k, v = (
        torch.randn(batch, heads, seq, dim, generator=generator).to(device=device, dtype=dtype)
        for _ in range(3)
    )
    out_grad = torch.randn(batch, seq, heads, dim, generator=generator).to(device, dtype)
    attention = nn.Module()
    attention.is_causal = True

    def sdpa_run(compressed_run):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if compressed_run:
            codecs_ = dict.fromkeys(("q", "k", "v"), deterministic)
            output, _ = compressed_sdpa_attention(
                attention, *leaves, None, is_causal=True, codecs=codecs_, cache=PackCache()
            )
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            output, _ = sdpa_attention_forward(attention, *leaves, None, is_causal=True)
        output.backward(out_grad)
        return tuple(leaf.grad for leaf in leaves)

    cases.append(
        ("SDPA, packed q/k/v recomputed, fwd+bwd vs stock", lambda: sdpa_run(True),
         lambda: sdpa_run(False), None)
    )  # fmt: skip
    return cases


def run_kernels(out: Path, device: torch.device, dry: bool, deadline: float) -> list:
    from hf_actq.kernels.registry import FAILED

    env_info, rows = environment(device), []
    repeats = 1 if dry else 20
    # The dry run checks the code, not the numbers: one dtype under the slow interpreter.
    dtypes = {"fp32": torch.float32} if dry else DTYPES
    for dtype_name, dtype in dtypes.items():
        for name, ours, stock, goal in kernel_cases(device, dtype, dry):
            if time.monotonic() > deadline:
                write(out, "kernels", rows, env_info, "stopped by the budget")
                return rows
            torch.manual_seed(0)
            kernel = ours()
            fell_back = ", ".join(sorted(FAILED))  # a twin in "kernel"'s place: no comparison
            with _Twins():
                torch.manual_seed(0)
                twin = ours()
            ours_s = _timed(ours, device, repeats)
            stock_s = _timed(stock, device, repeats)
            host_s = _host_timed(ours, device, min(repeats, 5))
            ratio = ours_s / stock_s
            if dtype_name == next(iter(dtypes)):
                # One interpreted call is a profile's worth in a dry run.
                calls = 1 if dry else 3
                _profile(ours, device, out / f"profile-kernel-{_slug(name)}.txt", calls)
            rows.append(
                {
                    "kernel": name,
                    "dtype": dtype_name,
                    "max |kernel - twin|": _difference(kernel, twin),
                    "ms": ours_s * 1e3,
                    "reference ms": stock_s * 1e3,
                    "host ms": host_s * 1e3,
                    "ratio": ratio,
                    "goal": goal,
                    "met": None if goal is None else ratio <= goal,
                    "kernels fallen back by then": fell_back,
                }
            )
            write(out, "kernels", rows, env_info)
    return rows


# Part 3: training steps ------------------------------------------------------------------------
def step_models(device: torch.device, dry: bool) -> list:
    """``(name, build() -> (model, batch), autocast dtype or None)``."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    def minilm():
        sizes = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12)
        sizes |= dict(intermediate_size=1536, vocab_size=30522)
        if dry:
            sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
            sizes |= dict(intermediate_size=64, vocab_size=100)
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(**sizes, num_labels=2)).to(device)
        batch, seq = (2, 16) if dry else (32, 128)
        ids = torch.randint(5, sizes["vocab_size"], (batch, seq), device=device)
        return model, {"input_ids": ids, "labels": torch.randint(0, 2, (batch,), device=device)}

    def llama_lora():
        from peft import LoraConfig, get_peft_model

        sizes = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32)
        sizes |= dict(num_key_value_heads=32, vocab_size=32000)
        if dry:
            sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
            sizes |= dict(num_key_value_heads=4, vocab_size=100)
        torch.manual_seed(0)
        config = LlamaConfig(**sizes, num_hidden_layers=2, attn_implementation="sdpa")
        model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
        model = get_peft_model(model, lora)
        batch, seq = (1, 32) if dry else (4, 2048)
        ids = torch.randint(5, sizes["vocab_size"], (batch, seq), device=device)
        return model, {"input_ids": ids, "labels": ids, "use_cache": False}

    return [
        ("MiniLM shapes, fp32, batch 32, seq 128", minilm, None),
        ("MiniLM shapes, bf16 autocast, batch 32, seq 128", minilm, torch.bfloat16),
        ("LLaMA2-7B shapes, 2 layers, LoRA r 16, bf16, batch 4, seq 2048", llama_lora, None),
    ]


def _patched(model, recipe: str):
    import hf_actq
    from hf_actq import ActQConfig

    model = copy.deepcopy(model)
    if recipe == "stock-checkpointing":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif RECIPES[recipe] is not None:
        name, overrides = RECIPES[recipe]
        hf_actq.apply(model, ActQConfig.from_recipe(name, **overrides))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-5)


def _step(runs: dict, batch: dict, device: torch.device, autocast, recipe: str) -> None:
    model, optimizer = runs[recipe]
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_steps(
    out: Path, device: torch.device, dry: bool, deadline: float, models: str | None = None
) -> list:
    """``models``: only the step models whose name contains it."""
    from hf_actq.memory import PeakMemory

    env_info, rows = environment(device), []
    rounds = 1 if dry else 8
    if dry:  # the kernels part ran them; here the interpreter would only be slow
        os.environ["HF_ACTQ_DISABLE_TRITON"] = "1"
    first_model = None  # profiled, each recipe once
    for model_name, build, autocast in step_models(device, dry):
        if time.monotonic() > deadline:
            break
        if models and models not in model_name:
            continue
        first_model = first_model or model_name
        model, batch = build()
        runs = {recipe: _patched(model, recipe) for recipe in RECIPES}
        del model
        step = functools.partial(_step, runs, batch, device, autocast)

        peaks, times = {}, {recipe: [] for recipe in RECIPES}
        for recipe in RECIPES:
            step(recipe)  # warm-up: the kernels compile here
            with PeakMemory(device) as peak:
                step(recipe)
            peaks[recipe] = peak.peak_bytes
        for index in range(rounds):
            if time.monotonic() > deadline and index:
                break
            labels = list(RECIPES)
            order = labels[index % len(labels) :] + labels[: index % len(labels)]
            for recipe in order:
                times[recipe].append(_timed(functools.partial(step, recipe), device, 1))
        base_time = statistics.median(times["baseline"])
        host = {
            recipe: _host_timed(functools.partial(step, recipe), device, 1) for recipe in RECIPES
        }
        if model_name == first_model:
            for recipe in RECIPES:
                path = out / f"profile-step-{_slug(model_name)}-{recipe}.txt"
                _profile(functools.partial(step, recipe), device, path, calls=1)
        for recipe in RECIPES:
            median = statistics.median(times[recipe])
            rows.append(
                {
                    "model": model_name,
                    "recipe": recipe,
                    "step ms": median * 1e3,
                    "time ratio": median / base_time,
                    "host ms": host[recipe] * 1e3,
                    "peak MiB": peaks[recipe] / 2**20,
                    "peak ratio": peaks[recipe] / max(peaks["baseline"], 1),
                    "rounds": len(times[recipe]),
                }
            )
        write(out, "steps", rows, env_info)
        del runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# Summary -------------------------------------------------------------------------------------
def report(out: Path) -> str:
    """``summary.md``: every part's table and the goals of issue 38, met or missed."""
    parts = {
        p: json.loads((out / f"{p}.json").read_text())
        for p in PARTS
        if (out / f"{p}.json").exists()
    }
    lines = ["# GPU check summary", ""]
    goals = []
    fallen = {k: v for d in parts.values() for k, v in d.get("kernels that fell back", {}).items()}
    goals += [f"kernel {name} failed, its twin ran instead: {why}" for name, why in fallen.items()]
    if "kernels" in parts:
        rows = parts["kernels"]["rows"]
        identical = [
            r for r in rows if r["max |kernel - twin|"] == 0 and not r.get("kernels fallen back by then")
        ]  # fmt: skip
        goals.append(f"kernels bit-identical with their twins: {len(identical)} of {len(rows)}")
        goals += [
            f"{r['kernel']} ({r['dtype']}): {r['ratio']:.2f}x, goal {r['goal']}x "
            + ("met" if r["met"] else "missed")
            for r in rows
            if r["goal"] is not None
        ]
    if "steps" in parts:
        rows = parts["steps"]["rows"]
        by = {(r["model"], r["recipe"]): r for r in rows}
        for (model, recipe), row in by.items():
            limit = {"fewbit": 1.03, "uniform-4": 1.15}.get(recipe)
            if recipe == "checkpoint" and (model, "stock-checkpointing") in by:
                limit = by[(model, "stock-checkpointing")]["time ratio"] + 0.05
            if limit is not None:
                met = "met" if row["time ratio"] <= limit else "missed"
                goals.append(
                    f"{model}, {recipe}: step {row['time ratio']:.3f}x, at most {limit:.3f}x: {met}"
                )
            if recipe != "baseline":
                met = "met" if row["peak ratio"] <= 1.0 else "missed"
                goals.append(f"{model}, {recipe}: peak {row['peak ratio']:.3f}x, at most 1: {met}")
    if "tests" in parts:
        for row in parts["tests"]["rows"]:
            goals.append(
                f"tests, {row['selection']}: {row['passed']} passed, {row['failed']} failed"
            )
    lines += [f"- {goal}" for goal in goals] + [""]
    for part, data in parts.items():
        lines.append(markdown(part, data))
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=[*PARTS, "all", "report"])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    parser.add_argument("--budget", type=float, help="seconds for the part (default: its own)")
    parser.add_argument(
        "--rerun", type=Path, help="tests: only what did not pass in this earlier tests-<n>.jsonl"
    )
    parser.add_argument("--models", help="steps: only the models whose name contains this")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "report":
        print(report(out))
        return 0
    dispatch = contextlib.nullcontext()
    if args.dry_run:
        from hf_actq.kernels import kernels_on_cpu

        # Under the interpreter the kernels run on CPU tensors: every op takes them, through
        # the dispatch a GPU goes through.
        dispatch, device = kernels_on_cpu(), torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    else:
        device = torch.device("cuda")
    runners = {"tests": run_tests, "kernels": run_kernels, "steps": run_steps}
    with dispatch:
        for part in PARTS if args.part == "all" else (args.part,):
            budget = args.budget or BUDGETS[part]
            began = time.monotonic()
            options = {"tests": {"rerun": args.rerun}, "steps": {"models": args.models}}
            runners[part](out, device, args.dry_run, began + budget, **options.get(part, {}))
            print(f"{part}: {time.monotonic() - began:.0f} s", flush=True)
    report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
