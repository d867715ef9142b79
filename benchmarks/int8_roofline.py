"""How close is a text encoder's INT8 model call to what ONNX Runtime's INT8 matrix kernels can do on this CPU?

Issue 19 asks for a served MiniLM at 2x Infinity's requests/s on single 128-token texts, where both servers run the
same model in dynamic INT8 on ONNX Runtime: the model call is most of the request. This measures, at one thread and at
every core:

- the model call on one text of ``--tokens`` tokens: its p50 (no profiler), and from ORT's profiler the share of
  operator time spent in the operators that are INT8 matrix products only (``DynamicQuantizeMatMul``,
  ``MatMulIntegerToFloat``, ``MatMulInteger``; the profiler slows multi-thread calls, so only its shares are used);
  their multiply-adds (every ``MatMulInteger`` weight, K x N, times the tokens) over p50 x that share is the rate
  the model's products run at;
- ``QAttention``, apart: it is the Q/K/V projection (an INT8 product) and the attention itself (softmax(QK^T)V per
  head, in fp32) in one operator. Its projection is counted at the rate of the other products; the rest of its time
  is the attention, reported as its share of the call (a quarter of the call at 128 tokens on a Zen 4 EPYC, where
  counting all of QAttention as INT8 product work had put the products' rate too low);
- the kernel's own rate: one ``DynamicQuantizeMatMul`` of 1024 x 1024 x 1024 (S8 weights), the best case for MLAS.

Prints both rates (GMAC/s), their ratio, and the call's p50 against the call with every INT8 product (projections
included) at the kernel's best rate and the rest unchanged. The two take turns block by block (``--rounds``); the
ratio is the median of per-round ratios.

    python benchmarks/int8_roofline.py --model RUN/artifacts/<quantize-dynamic>/model.onnx [--tokens 128] [--rounds 5] \
        [--against WORK/infinity-model/model_quantized.onnx]
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
from servopt.machine import header
from servopt.peers.runner import round_order
from servopt.runtimes import open_session

INT8_PRODUCTS = {"DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger"}  # nothing but the product
ATTENTION = "QAttention"  # the Q/K/V projection (INT8) and the attention itself (fp32) in one operator


def int8_macs_per_token(path: Path, ops: tuple[str, ...] = ("MatMulInteger", ATTENTION)) -> int:
    """Multiply-adds per token of the graph's INT8 matrix products of type ``ops``: the K x N of each weight."""
    model = onnx.load(path)
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    total = 0
    for node in model.graph.node:
        if node.op_type in ops:
            dims = inits.get(node.input[1])
            if dims and len(dims) == 2:
                total += dims[0] * dims[1]
    return total


def split_call(call_s: float, product_share: float, attention_share: float, product_macs: float, projection_macs: float,
               kernel_gmacs: float) -> dict:
    """One call's time split: the INT8 products' rate (their multiply-adds over their time), the attention inside
    ``QAttention`` (its time less its projection's at that rate), and the call with every product, projections
    included, at the kernel's rate and the rest as it is."""
    product_s = call_s * product_share
    rate = product_macs / product_s if product_s > 0 else 0.0
    projection_s = projection_macs / rate if rate else 0.0
    attention_s = max(0.0, call_s * attention_share - projection_s)
    rest_s = call_s - product_s - projection_s - attention_s
    at_kernel_s = (product_macs + projection_macs) / (kernel_gmacs * 1e9) + attention_s + rest_s
    return {"products_gmacs": rate / 1e9, "attention_share": attention_s / call_s, "rest_share": rest_s / call_s,
            "call_at_kernel_rate_ms": at_kernel_s * 1e3}


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
    ap.add_argument("--against", type=Path, default=None,
                    help="another INT8 encoder of the same model (e.g. text_servers.py's WORK/infinity-model/model_quantized.onnx, "
                         "the one Infinity serves), its call timed in turn with this one: is the peer's model call any slower?")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    product_macs = int8_macs_per_token(args.model, ("MatMulInteger",)) * args.tokens
    projection_macs = int8_macs_per_token(args.model, (ATTENTION,)) * args.tokens
    macs = product_macs + projection_macs
    ids = np.random.default_rng(0).integers(1000, 20000, (1, args.tokens)).astype(np.int64)
    feed_all = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    tmp = Path(tempfile.mkdtemp(prefix="int8-roofline-"))
    size = 1024
    gemm = kernel_graph(tmp / "gemm.onnx", size, size)
    a = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    print(f"CPU: {header()}; {args.model}: {macs / 1e9:.3f} G INT8 multiply-adds at "
          f"{args.tokens} tokens")
    rows = []
    for threads in args.threads:
        # Opened as servopt opens them (its CPU graph optimizations and fusion policy); ORT's profiler by operator type.
        s = open_session(Artifact(format="onnx", path=str(args.model)), "onnxruntime", {"intra_op_threads": threads})
        g = open_session(Artifact(format="onnx", path=str(gemm)), "onnxruntime", {"intra_op_threads": threads})
        feed = {k: v for k, v in feed_all.items() if k in s.input_names}
        peer = open_session(Artifact(format="onnx", path=str(args.against)), "onnxruntime", {"intra_op_threads": threads}) if args.against else None
        peer_feed = {k: v for k, v in feed_all.items() if peer and k in peer.input_names}
        calls, kernels, peers = [], [], []
        blocks = {"call": lambda s=s, feed=feed: s.run(feed), "kernel": lambda g=g: g.run({"A": a}),
                  **({"peer": lambda peer=peer, pf=peer_feed: peer.run(pf)} if peer is not None else {})}
        for r in range(args.rounds):  # interleaved, the order flipped: the machine's speed drifts by tens of % a minute
            got = {k: p50(blocks[k], args.seconds) for k in round_order(list(blocks), r)}
            calls.append(got["call"])
            kernels.append(got["kernel"])
            if peer is not None:
                peers.append(got["peer"])
        call, kernel = statistics.median(calls), statistics.median(kernels)
        ops = s.profile([feed], runs=30, top=1000).ops
        share = sum(o.share for o in ops if o.op in INT8_PRODUCTS)
        attention = sum(o.share for o in ops if o.op == ATTENTION)
        kernel_rate = size ** 3 / kernel / 1e9
        split = split_call(call, share, attention, product_macs, projection_macs, kernel_rate)
        per_round = sorted(split_call(c, share, attention, product_macs, projection_macs, kernel_rate)["products_gmacs"] / (size ** 3 / k / 1e9)
                           for c, k in zip(calls, kernels, strict=True))
        row = {"threads": threads, "call_p50_ms": call * 1e3, "products_share": share, "qattention_share": attention,
               "model_gmacs": split["products_gmacs"], "kernel_gmacs": kernel_rate, "model_over_kernel": statistics.median(per_round),
               "model_over_kernel_range": [per_round[0], per_round[-1]], "attention_share": split["attention_share"],
               "rest_share": split["rest_share"], "products_at_kernel_rate_ms": macs / kernel_rate / 1e6,
               "call_at_kernel_rate_ms": split["call_at_kernel_rate_ms"]}
        if peers:
            over = sorted(p / c for p, c in zip(peers, calls, strict=True))
            row.update({"against_p50_ms": statistics.median(peers) * 1e3, "against_over_call": statistics.median(over),
                        "against_over_call_range": [over[0], over[-1]]})
        rows.append(row)
        print(f"threads {threads}: call p50 {row['call_p50_ms']:.2f} ms: {100 * share:.0f} % in INT8 products (their rate "
              f"{row['model_gmacs']:.1f} GMAC/s), {100 * attention:.0f} % in QAttention, of which the attention itself "
              f"{100 * row['attention_share']:.0f} % of the call, the rest {100 * row['rest_share']:.0f} %; the kernel at "
              f"{size}^3: {kernel_rate:.1f} GMAC/s (products / kernel {row['model_over_kernel']:.2f}, rounds "
              f"{per_round[0]:.2f}-{per_round[-1]:.2f}); every product at the kernel's rate: the products "
              f"{row['products_at_kernel_rate_ms']:.2f} ms, the call {row['call_at_kernel_rate_ms']:.2f} ms", flush=True)
        if peers:
            print(f"  {args.against.name}: call p50 {row['against_p50_ms']:.2f} ms, {row['against_over_call']:.2f}x this model's "
                  f"(rounds {over[0]:.2f}-{over[-1]:.2f})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cpu": header(), "tokens": args.tokens,
                                        "int8_macs": macs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
