"""How close is a text encoder's INT8 model call to what ONNX Runtime's INT8 matrix kernels can do on this CPU?

Issue 19 asks for a served MiniLM at 2x Infinity's requests/s on single 128-token texts, where both servers run the
same model in dynamic INT8 on ONNX Runtime: the model call is most of the request. This measures, at one thread and at
every core:

- the model call on one text of ``--tokens`` tokens: its p50 (no profiler), and from ORT's profiler the share of
  operator time spent in the operators doing INT8 matrix products (``DynamicQuantizeMatMul``,
  ``MatMulIntegerToFloat``, ``QAttention``; the profiler slows multi-thread calls, so only its shares are used);
  their multiply-adds (every ``MatMulInteger``/``QAttention`` weight, K x N, times the tokens) over p50 x that share
  is the rate the model's products run at;
- the kernel's own rate: one ``DynamicQuantizeMatMul`` of 1024 x 1024 x 1024 (S8 weights), the best case for MLAS.

Prints both rates (GMAC/s), their ratio, and the call's p50 against the time its INT8 products alone would take at
the kernel's best rate. The two take turns block by block (``--rounds``); the ratio is the median of per-round ratios.

    python benchmarks/int8_roofline.py --model RUN/artifacts/<quantize-dynamic>/model.onnx [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from servopt.contracts import Artifact
from servopt.machine import cpu_features, cpu_model
from servopt.runtimes import open_session

INT8_PRODUCTS = {"DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "MatMulInteger"}


def int8_macs_per_token(path: Path) -> int:
    """Multiply-adds per token of the graph's INT8 matrix products: the K x N of each weight they multiply by."""
    model = onnx.load(path)
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    total = 0
    for node in model.graph.node:
        if node.op_type in ("MatMulInteger", "QAttention"):
            dims = inits.get(node.input[1])
            if dims and len(dims) == 2:
                total += dims[0] * dims[1]
    return total


def p50(run, seconds: float) -> float:
    for _ in range(5):
        run()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 10:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_graph(path: Path, k: int, n: int) -> Path:
    rng = np.random.default_rng(0)
    # 7-bit weights: full-range S8 saturates AVX2's U8S8 product (vpmaddubsw) and the answer would be wrong, though
    # no slower (the kernel's time does not depend on the values).
    inits = [numpy_helper.from_array(rng.integers(-64, 64, (k, n), dtype=np.int8), "B"),
             numpy_helper.from_array(np.full(n, 0.01, np.float32), "scale"),
             numpy_helper.from_array(np.zeros(n, np.int8), "zero")]
    node = helper.make_node("DynamicQuantizeMatMul", ["A", "B", "scale", "zero"], ["Y"], domain="com.microsoft")
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="a servopt-built dynamic INT8 text encoder (.onnx)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, os.cpu_count() or 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="per block: the model, then the kernel, each round")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    macs = int8_macs_per_token(args.model) * args.tokens
    ids = np.random.default_rng(0).integers(1000, 20000, (1, args.tokens)).astype(np.int64)
    feed_all = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    tmp = Path(tempfile.mkdtemp(prefix="int8-roofline-"))
    size = 1024
    gemm = kernel_graph(tmp / "gemm.onnx", size, size)
    a = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    print(f"CPU: {cpu_model()} ({cpu_features().describe()}); {args.model}: {macs / 1e9:.3f} G INT8 multiply-adds at "
          f"{args.tokens} tokens")
    rows = []
    for threads in args.threads:
        # Opened as servopt opens them (its CPU graph optimizations and fusion policy); ORT's profiler by operator type.
        s = open_session(Artifact(format="onnx", path=str(args.model)), "onnxruntime", {"intra_op_threads": threads})
        g = open_session(Artifact(format="onnx", path=str(gemm)), "onnxruntime", {"intra_op_threads": threads})
        feed = {k: v for k, v in feed_all.items() if k in s.input_names}
        calls, kernels = [], []
        for _ in range(args.rounds):  # interleaved: the machine's speed drifts by tens of % between minutes
            calls.append(p50(lambda s=s, feed=feed: s.run(feed), args.seconds))
            kernels.append(p50(lambda g=g: g.run({"A": a}), args.seconds))
        call, kernel = statistics.median(calls), statistics.median(kernels)
        ops = s.profile([feed], runs=30, top=1000).ops
        share = sum(o.share for o in ops if o.op in INT8_PRODUCTS)
        kernel_rate = size ** 3 / kernel / 1e9
        model_rate = macs / (call * share) / 1e9
        per_round = sorted((macs / (c * share)) / (size ** 3 / k) for c, k in zip(calls, kernels, strict=True))
        row = {"threads": threads, "call_p50_ms": call * 1e3, "products_share": share, "model_gmacs": model_rate,
               "kernel_gmacs": kernel_rate, "model_over_kernel": statistics.median(per_round),
               "model_over_kernel_range": [per_round[0], per_round[-1]],
               "products_at_kernel_rate_ms": macs / kernel_rate / 1e6}
        rows.append(row)
        print(f"threads {threads}: call p50 {row['call_p50_ms']:.2f} ms, {100 * share:.0f} % of it in INT8 products, "
              f"at {model_rate:.1f} GMAC/s; the kernel at "
              f"{size}^3: {kernel_rate:.1f} GMAC/s (model / kernel {row['model_over_kernel']:.2f}, rounds "
              f"{per_round[0]:.2f}-{per_round[-1]:.2f}); the products at the "
              f"kernel's rate would take {row['products_at_kernel_rate_ms']:.2f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu_model(), "flags": sorted(cpu_features().flags), "tokens": args.tokens,
                                        "int8_macs": macs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
