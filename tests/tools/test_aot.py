"""Every Triton kernel variant the dispatcher can launch compiles for sm_80 and sm_90.

Runs ``python tools/aot.py`` in a subprocess without TRITON_INTERPRET (the interpreter
would replace the compiler), which needs no GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))


def _compile(tmp_path, *extra, ccs=(80, 90), timeout=900) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every run
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "aot.py"), "--cc", *map(str, ccs), "--json", str(out)]
        + list(extra),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {r["cc"] for r in results} == set(ccs)
    assert all(r["cubin_bytes"] > 0 for r in results)
    # aot.py fails a variant that spills; the figures must be there for that to mean anything.
    assert all("stack_bytes" in r for r in results)
    return results


def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """The default run: every kernel once, in bf16 where it takes bf16. Every float type and
    index width (``--representative types``) and the full constexpr grid are the slow tests."""
    from aot import representatives, variants

    chosen = representatives(variants(), "kernel")
    assert {v.kernel for v in chosen} == {v.kernel for v in variants()}
    assert len(chosen) == len({v.kernel for v in variants()})
    results = _compile(tmp_path, "--representative", "kernel")
    assert sorted(r["variant"] for r in results) == sorted(2 * [v.label for v in chosen])
    assert any("fewbit_backward_kernel" in r["variant"] and "bf16" in r["variant"] for r in results)


@pytest.mark.slow
def test_every_kernel_compiles_with_each_of_its_argument_types(tmp_path):
    from aot import representatives, variants

    chosen = representatives(variants(), "types")
    results = _compile(tmp_path, "--representative", "types")
    assert sorted(r["variant"] for r in results) == sorted(2 * [v.label for v in chosen])
    labels = {r["variant"] for r in results}
    for dtype in ("fp32", "fp16", "bf16"):
        assert any("fewbit_backward_kernel" in label and dtype in label for label in labels)
    assert any("i64" in label for label in labels)


def test_smaq_quantize_kernel_at_its_default_capacity_keeps_its_tile_in_registers(tmp_path):
    """Its outliers were matched against all BLOCK slots (a 256 x 256 tile): 3.5 KB of stack
    per thread, 300-1400x two copies on an H200. Now a scan over each block's outliers."""
    from aot import INDEX_TYPES

    from hf_actq.codecs.smaq import SmaQCodec
    from hf_actq.kernels.smaq import extension_bytes_pad

    codec = SmaQCodec()
    pad = extension_bytes_pad(codec.slots)
    kernel = f"smaq_quantize_kernel BLOCK={codec.block_size} "
    rounding = f"BYTES_PAD={pad} STOCHASTIC=True SEED_IN_MEMORY=False src_ptr:*bf16"
    results = _compile(tmp_path, "--match", kernel, rounding)
    assert len(results) == 2 * len(INDEX_TYPES)
    assert all(r["stack_bytes"] == 0 for r in results), results


def test_the_variants_are_every_launchable_kernel_configuration():
    from aot import (
        FLOAT_TYPES,
        GATED_LAYOUTS,
        INDEX_TYPES,
        STRIDED_BLPA,
        STRIDED_CODECS,
        STRIDED_WIDTHS,
        codec_shapes,
        rotated_shapes,
        variants,
    )

    from hf_actq.codecs.packed import BLOCK_SIZES
    from hf_actq.codecs.smaq import BLOCK_SIZES as SMAQ_BLOCK_SIZES
    from hf_actq.fewbit.dp import MAX_BITS
    from hf_actq.kernels.fewbit import CODE_MODES, FUSED_ACTIVATIONS

    shapes = codec_shapes(BLOCK_SIZES)
    assert {bits for bits, group, _ in shapes if group == 1} == set(range(1, 9))
    assert {group for _, group, _ in shapes} == {1, 2, 4, 8, 16}
    # fewbit forward: codes only (every code mode at 1 bit, table and symmetric at 2..4 bits)
    # and with the output of each activation it reproduces (at 1 and 3 bits); fewbit backward
    # per width; seeded dropout; aq quantize (deterministic, stochastic with the seed as an
    # argument and read from memory) and dequantize per codec shape, blpa's two per shape of
    # group 1; smaq
    per_float_type = len(CODE_MODES) + 2 * (MAX_BITS - 1) + 2 * len(FUSED_ACTIVATIONS)
    per_float_type += MAX_BITS + 1
    # gated backward (few-bit 1 and 3 bits, with and without the product) and forward (few-bit
    # 1 and 3 bits, silu and gelu) per layout
    # and the forward on the halves of one projection's output (1 bit, silu) per layout
    per_float_type += len(GATED_LAYOUTS) * (2 * (2 + 2) + 1)
    per_float_type += 4 * len(shapes) + 2 * sum(group == 1 for _, group, _ in shapes)
    # aq quantize of strided rows: per strided codec and width, the three seed forms
    per_float_type += 3 * len(STRIDED_CODECS) * len(STRIDED_WIDTHS)
    per_float_type += len(STRIDED_BLPA) * len(STRIDED_WIDTHS)  # and blpa's
    # SmaQ: dequantize per block size, quantize per block size and extension tile (a power of two
    # from 1 to block // 4 bytes), deterministic and stochastic with the seed as an argument and
    # read from memory
    per_float_type += sum(1 + 3 * (block // 4).bit_length() for block in SMAQ_BLOCK_SIZES)
    per_float_type += 1  # SmaQ's statistics
    # SmaQ of strided rows: statistics per width, quantize per width and seed form (its default
    # block and capacity)
    per_float_type += len(STRIDED_WIDTHS) * (1 + 3)
    # The rotated pack (three seed forms) and unpack per rotated shape
    per_float_type += 4 * len(rotated_shapes(BLOCK_SIZES))
    per_mask_type = 2
    per_index_type = 1  # SmaQ's combination of its statistics' partials (fp32)
    expected = len(INDEX_TYPES) * (
        len(FLOAT_TYPES) * per_float_type + (len(FLOAT_TYPES) + 1) * per_mask_type + per_index_type
    )
    # The norm kernels: the two backward kernels (i32 indices) on x_hat, on three pack layouts
    # and on three forms of a memory-sharing norm's output; the forward per form (LayerNorm,
    # LLaMA's and Gemma's RMSNorm) and three layouts.
    expected += len(FLOAT_TYPES) * (2 * 7 + 3 * 3)
    assert len(variants()) == expected
    # Every @triton.jit kernel in the package is among the variants (helpers are not kernels).
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import hf_actq.kernels

    defined = set()
    for info in pkgutil.iter_modules(hf_actq.kernels.__path__):
        module = importlib.import_module(f"hf_actq.kernels.{info.name}")
        defined |= {
            name
            for name, value in vars(module).items()
            if isinstance(value, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")
        }
    assert {v.kernel for v in variants()} == defined
    assert len(defined) == 24


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 2,500 compilations on 2 cores: past the default 15 minutes
def test_all_kernel_variants_compile_for_sm90(tmp_path):
    """Every constexpr choice, for sm_90. The constexprs fold in Triton's front end, before
    anything depends on the architecture; the argument types that reach the back end are
    compiled for sm_80 and sm_90 both by the test above. (Both architectures for every variant
    took past 40 minutes on 2 cores.)"""
    from aot import variants

    results = _compile(tmp_path, ccs=(90,), timeout=1700)
    assert len(results) == len(variants())
    labels = {r["variant"] for r in results}
    assert any("fewbit_backward_kernel" in label and "bf16" in label for label in labels)


GATE_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
import triton.language as tl
from aot import _variant, compile_kernel

@triton.jit
def aq_quantize_kernel(src_ptr, out_ptr, n_elements, width, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # A runtime divisor, as the kernels before the redesign indexed their blocks.
    row = offsets // width
    tl.store(out_ptr + offsets, tl.load(src_ptr + row, mask=offsets < n_elements))

signature = {"src_ptr": "*bf16", "out_ptr": "*bf16", "n_elements": "i32", "width": "i32"}
variant = _variant("probe", "aq_quantize_kernel", signature, {"BLOCK": 1024})
print(json.dumps(compile_kernel(aq_quantize_kernel, variant, 90)))
"""


def test_the_bandwidth_gate_fails_a_kernel_that_divides_and_gathers(tmp_path):
    """What the gate looks for is there to find: a kernel that gathers its float input by a
    runtime division (the old kernels' indexing) compiled as a bandwidth kernel is flagged
    twice."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    probe = tmp_path / "probe.py"
    probe.write_text(GATE_PROBE)
    proc = subprocess.run(
        [sys.executable, str(probe), str(TOOLS)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["integer_divisions"] > 0
    assert any("integer divisions" in problem for problem in result["problems"])
    assert any("scalar accesses" in problem for problem in result["problems"])


@pytest.mark.slow  # 29 s; the default run gates each kernel's representative
def test_the_codec_kernels_stream(tmp_path):
    """AQ's bf16 pack (stochastic, seeded from the host: an eager training step's) and unpack
    kernels at every width and group (other seed forms, types and kernels: the slow tests' full
    compiles): no software division, 128-bit accesses to the float tensor, no stack (aot.py
    fails them otherwise)."""
    from aot import BANDWIDTH_KERNELS

    # sm_90 (the H100 and H200 the speed goals are set on); sm_80 compiles in the test above.
    match = ("_kernel", "BLOCK=128", "n_means:i32", "bf16")
    pack = ("aq_quantize_kernel STOCHASTIC=True SEED_IN_MEMORY=False", *match)
    results = _compile(tmp_path, "--match", "aq_dequantize", *match, "--match", *pack, ccs=(90,))
    assert {r["kernel"] for r in results} == {"aq_quantize_kernel", "aq_dequantize_kernel"}
    assert len(results) == 32
    assert {int(r["variant"].split("GROUP=")[1].split()[0]) for r in results} == {1, 2, 4, 8, 16}
    assert all(not r["problems"] for r in results)
    assert all(r["sass"].get(BANDWIDTH_KERNELS[r["kernel"]], 0) > 0 for r in results)


@pytest.mark.slow  # the default run gates each kernel's representative
def test_the_rotated_kernels_stream(tmp_path):
    """The rotated pack (stochastic, seeded from the host: an eager training step's) and unpack,
    the rotation a tensor-core product inside each, at every width, bf16, sm_90: no software
    division, 128-bit accesses to the tensor, no stack (other seed forms: the slow compiles)."""
    from aot import BANDWIDTH_KERNELS

    match = ("BLOCK=128", "ptr:*bf16", "n_elements:i32")  # bf16 in and out
    pack = ("rotated_quantize_kernel STOCHASTIC=True SEED_IN_MEMORY=False", *match)
    unpack = ("rotated_dequantize", *match)
    results = _compile(tmp_path, "--match", *unpack, "--match", *pack, ccs=(90,))
    assert len(results) == 16
    assert {r["kernel"] for r in results} == {
        "rotated_quantize_kernel",
        "rotated_dequantize_kernel",
    }
    assert {int(r["variant"].split("BITS=")[1].split()[0]) for r in results} == set(range(1, 9))
    assert all(not r["problems"] for r in results)
    assert all(r["sass"].get(BANDWIDTH_KERNELS[r["kernel"]], 0) > 0 for r in results)


@pytest.mark.slow  # the default run gates each kernel's representative
def test_the_few_bit_kernels_stream(tmp_path):
    """The few-bit forward (codes only and fused with PyTorch's formula through libdevice) and
    backward at 3 bits in bf16: 128-bit accesses to the float tensors, no software division,
    no stack."""
    from aot import BANDWIDTH_KERNELS

    from hf_actq.kernels.fewbit import FUSED_ACTIVATIONS

    results = _compile(tmp_path, "--match", "fewbit", "BITS=3", "bf16", "n_elements:i32", ccs=(90,))
    fused = [r for r in results if "LIBDEVICE=True" in r["variant"]]
    assert len(fused) == len(FUSED_ACTIVATIONS) and len(results) == len(fused) + 3
    assert all(not r["problems"] for r in results)
    assert all(r["sass"].get(BANDWIDTH_KERNELS[r["kernel"]], 0) > 0 for r in results)
    assert all(r["sass"].get("STG.E.128", 0) > 0 for r in fused)  # the output, vectorised


@pytest.mark.slow  # the default run gates each kernel's representative
def test_the_gated_kernels_stream(tmp_path):
    """Uniform 4-bit operands, 3-bit codes, bf16: the backward with and without down's input,
    the forward fused with SiLU: 128-bit accesses to the float tensors, no software division,
    no stack."""
    from aot import BANDWIDTH_KERNELS

    results = _compile(tmp_path, "--match", "A_BITS=4", "BITS=3", "bf16", "n_elements:i32")
    results = [r for r in results if "ACTIVATION=0 " not in r["variant"]]  # gelu's
    kernels = sorted(r["kernel"] for r in results)
    # with and without the product; SiLU; each for sm_80 and sm_90
    assert kernels == ["gated_backward_kernel"] * 4 + ["gated_forward_kernel"] * 2, kernels
    assert all(not r["problems"] for r in results)
    assert all(r["sass"].get(BANDWIDTH_KERNELS[r["kernel"]], 0) > 0 for r in results)


def test_the_norm_backward_kernels_stream(tmp_path):
    """Both norm backward kernels, on x_hat, on its 4-bit pack and rebuilding it from a
    memory-sharing LayerNorm's and RMSNorm's output, bf16, with the row width a
    multiple of 16 as the JIT specializes it at every real hidden size: 128-bit loads of the
    gradient (and x_hat), 128-bit stores of the input's gradient, no software division, no
    stack. (aot.py compiled them without the width's alignment before: scalar accesses.)"""
    from aot import BANDWIDTH_KERNELS

    # On x_hat (its BITS are unused), on its 4-bit pack, from the output of a norm with weight.
    groups = ("PACKED=False BITS=8", "FROM_OUTPUT=False"), ("PACKED=True BITS=4",), ("GUARD=True",)
    arguments = [text for group in groups for text in ("--match", "norm_", *group, "bf16")]
    results = _compile(tmp_path, *arguments, ccs=(90,))
    kernels = sorted(r["kernel"] for r in results)
    # On x_hat, on its 4-bit pack, from a LayerNorm's and an RMSNorm's output.
    assert kernels == ["norm_backward_kernel"] * 4 + ["norm_row_means_kernel"] * 4, kernels
    assert all(not r["problems"] for r in results)
    assert all(r["sass"].get(BANDWIDTH_KERNELS[r["kernel"]], 0) > 0 for r in results)
    assert all(r["sass"].get("LDG.E.128", 0) > 0 for r in results)
