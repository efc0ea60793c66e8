"""The native decoder's typed layer descriptors and the one function that turns them into what the C++
``DecoderStack`` takes (without the kernels: a stand-in records the calls)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import iterserve
from iterserve.models.native_decoder import (
    LinearKind,
    NativeDecoder,
    NativeLayer,
    NativeLinear,
    NativeStack,
    build_stack,
)

CSRC = Path(iterserve.__file__).parent / "csrc"
CPP_NAMES = {LinearKind.DENSE: "kDense", LinearKind.COLUMN_BLOCKED: "kPacked", LinearKind.QUANTIZED: "kQuantized",
             LinearKind.GGUF: "kGguf"}


class Recorder:
    """Stands in for the kernels' op set and the stack it makes: keeps what they are called with."""

    def __init__(self) -> None:
        self.made: tuple = ()
        self.layers: list[tuple] = []
        self.linears: list[tuple] = []

    def decoder_stack(self, *args):
        self.made = args
        return self

    def add_layer(self, *args) -> None:
        self.layers.append(args)

    def add_linear(self, *args) -> None:
        self.linears.append(args)


def test_linear_kinds_are_the_cpp_enum():
    """Each kind's value is the one ``csrc``'s ``LinearKind`` gives the same kind."""
    text = "".join(p.read_text() for p in sorted(CSRC.glob("*.[ch]*")))
    body = re.search(r"enum LinearKind\b[^{]*\{([^}]*)\}", text)
    assert body is not None, "csrc declares enum LinearKind"
    cpp = {name: int(value) for name, value in re.findall(r"(k\w+)\s*=\s*(\d+)", body.group(1))}
    assert {kind: cpp[name] for kind, name in CPP_NAMES.items()} == {kind: kind.value for kind in LinearKind}
    assert len(cpp) == len(LinearKind)


def test_build_stack_gives_each_kind_its_weight_and_param():
    w = [torch.zeros(4, 2) for _ in range(3)]
    bias = torch.ones(4)
    dense = NativeLinear(LinearKind.DENSE, [w[0]], 4, None)
    blocked = NativeLinear(LinearKind.COLUMN_BLOCKED, [w[1]], 4, bias, amx_min_rows=16)
    quantized = NativeLinear(LinearKind.QUANTIZED, [w[2]], 4, None, bits=4)
    gguf = NativeLinear(LinearKind.GGUF, w[:2], 6, None, type_ids=[12, 14], part_rows=[4, 2])
    norms = [torch.full((2,), float(i)) for i in range(4)]
    layers = [NativeLayer(norms[0], norms[1], None, None, dense, blocked, quantized, gguf),
              NativeLayer(norms[2], norms[3], norms[0], norms[1], gguf, dense, dense, dense, norms[1], norms[2], 6)]
    ops = Recorder()
    assert build_stack(ops, NativeStack(4, 2, 8, 1e-6, 0.125, layers)) is ops  # type: ignore[arg-type]
    assert ops.made == (4, 2, 8, 1e-6, 0.125, False)
    first, second = ops.layers
    assert first == (norms[0], norms[1], None, None, None, None, 0)
    assert second == (norms[2], norms[3], norms[0], norms[1], norms[1], norms[2], 6)  # Gemma 3's MLP norms, window
    assert len(ops.linears) == 8  # four a layer, each its kind, weights, out_features, params and bias
    assert ops.linears[0] == (0, [w[0]], 4, [0], None)
    assert ops.linears[1] == (1, [w[1]], 4, [16], bias)
    assert ops.linears[2] == (2, [w[2]], 4, [4], None)
    assert ops.linears[3] == (3, w[:2], 6, [12, 14, 4, 2], None)
    assert ops.linears[4] == ops.linears[3]


def test_no_native_decoder_off_the_cpu():
    assert NativeDecoder.for_device("meta") is None
