"""The ``serve``, ``loadtest`` and ``package`` commands (no torch imported on this path)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from servopt.cli import app, console, run_cli
from servopt.errors import UserError


def _served(source: Path, target: str | None, variant: str | None, name: str | None, runtime: str | None,
            graph_level: str | None, threads: int | None, hint: str | None, instances: int | None):
    from servopt.serve.model import apply_instance_defaults, from_file, from_run

    if source.is_dir():
        model = from_run(source, target, variant)
        if name:
            model.name = name
    else:
        if target or variant:
            raise UserError("--target/--variant pick from a run directory", fix="pass the run directory, or drop them")
        options = {}
        if graph_level:
            options["graph_optimization_level"] = graph_level
        if hint:
            options["hint"] = hint
        model = from_file(source, name, runtime, options)
    apply_instance_defaults(model, instances, threads)
    return model


@app.command()
def serve(
    source: Annotated[Path, typer.Argument(help="a run directory of `servopt optimize`, an .onnx file or an OpenVINO .xml")],
    target: Annotated[str | None, typer.Option(help="serve the variant recommended for this target (run directory)")] = None,
    variant: Annotated[str | None, typer.Option(help="serve this variant of the run directory")] = None,
    name: Annotated[str | None, typer.Option(help="model name in URLs (default: the file stem)")] = None,
    host: Annotated[str, typer.Option(help="address to bind; 127.0.0.1 unless you mean to expose it")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    max_batch: Annotated[int, typer.Option(help="largest merged batch")] = 32,
    max_delay_us: Annotated[int, typer.Option(help="how long a request may wait to be batched, µs")] = 2000,
    max_queue: Annotated[int, typer.Option(help="samples allowed to wait; past it 503 + Retry-After")] = 256,
    no_batching: Annotated[bool, typer.Option("--no-batching", help="run each request alone")] = False,
    instances: Annotated[int | None, typer.Option(
        help="model instances (sessions) serving the queue (default: 2 single-thread instances for a throughput "
             "target of a run directory, else 1)")] = None,
    timeout: Annotated[float, typer.Option(help="per-request timeout, s (504 past it)")] = 30.0,
    max_body_mb: Annotated[float, typer.Option(help="request size limit (413 past it)")] = 32.0,
    limit_concurrency: Annotated[int | None, typer.Option(
        help="uvicorn's limit on connections + requests in progress (503 at header time); idle keep-alive "
             "connections count too. Default: none (the bounded queue refuses instead)")] = None,
    api_key: Annotated[str | None, typer.Option(help="require 'Authorization: Bearer KEY' (or set SERVOPT_API_KEY)")] = None,
    runtime: Annotated[str | None, typer.Option(help="onnxruntime (default for .onnx) or openvino")] = None,
    graph_level: Annotated[str | None, typer.Option(help="ONNX Runtime graph optimization level")] = None,
    threads: Annotated[int | None, typer.Option(help="intra-op threads")] = None,
    hint: Annotated[str | None, typer.Option(help="OpenVINO performance hint: LATENCY or THROUGHPUT")] = None,
) -> None:
    """Serve a model over the Open Inference Protocol v2 (KServe/Triton) with dynamic batching."""

    def go() -> None:
        import uvicorn

        from servopt.serve.app import ServeSettings, api_key_from_env, create_app

        model = _served(source, target, variant, name, runtime, graph_level, threads, hint, instances)
        settings = ServeSettings(max_batch=max_batch, max_delay_us=max_delay_us, max_queue=max_queue, request_timeout_s=timeout,
                                 max_body_mb=max_body_mb, api_key=api_key_from_env(api_key), batching=not no_batching)
        console.print(f"serving [bold]{model.name}[/bold] ({model.artifact['format']} on {model.runtime}, {model.instances} instance(s)) "
                      f"at http://{host}:{port}/v2/models/{model.name}"
                      f"  batching: {'off' if no_batching else f'max {max_batch}, {max_delay_us} µs'}; "
                      f"auth: {'bearer token' if settings.api_key else 'none'}")
        uvicorn.run(create_app({model.name: model}, settings), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=int(timeout) + 5, limit_concurrency=limit_concurrency)

    run_cli(go)


@app.command()
def loadtest(
    url: Annotated[str, typer.Argument(help="the server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="model name on the server")],
    concurrency: Annotated[str | None, typer.Option(help="closed-loop steps, e.g. 1,8,32,64")] = None,
    rate: Annotated[str | None, typer.Option(help="open-loop steps in requests/s, e.g. 100,300")] = None,
    distribution: Annotated[str, typer.Option(help="open-loop arrivals: poisson or constant")] = "poisson",
    duration: Annotated[float, typer.Option(help="seconds per step")] = 20.0,
    warmup: Annotated[float, typer.Option(help="uncounted seconds before each step")] = 3.0,
    max_requests: Annotated[int, typer.Option(help="at most this many requests per closed-loop step")] = 1_000_000,
    json_body: Annotated[bool, typer.Option("--json-body", help="send JSON tensors instead of Triton binary tensors")] = False,
    batch: Annotated[int, typer.Option(help="samples per request")] = 1,
    image: Annotated[Path | None, typer.Option(help="send this image to the classify endpoint instead")] = None,
    api_key: Annotated[str | None, typer.Option(help="bearer token (or SERVOPT_API_KEY)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the figures to this JSON file")] = None,
) -> None:
    """Load-test a v2 server: closed loop at fixed concurrencies, open loop at fixed rates."""

    def go() -> None:
        from servopt.cli_common import parse_int_list
        from servopt.results import write_json_atomic
        from servopt.serve.app import api_key_from_env
        from servopt.serve.loadtest import run_loadtest

        if not concurrency and not rate:
            raise UserError("nothing to run", fix="pass --concurrency 1,8,32 and/or --rate 100,300")
        if distribution not in ("poisson", "constant"):
            raise UserError(f"unknown distribution {distribution!r}", fix="use poisson or constant")
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{url!r} is not an http(s) URL", fix="e.g. http://127.0.0.1:8000")
        rates = [float(r) for r in rate.split(",")] if rate else []
        if any(r <= 0 for r in rates):
            raise UserError("rates must be positive", fix="e.g. --rate 100,300")
        table = Table(title=f"servopt loadtest {url} ({model})", title_style="bold")
        for col in ("mode", "level", "ok", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors", "queue ms", "compute ms/batch", "batch"):
            table.add_column(col, justify="left" if col in ("mode", "errors") else "right")

        def add(s: dict) -> None:
            srv = s.get("server") or {}
            lat = s["latency_ms"]
            level = s.get("concurrency", s.get("rate_rps"))
            table.add_row(s["mode"], f"{level:g}", str(s["ok"]), f"{s['throughput_rps']:.0f}", f"{lat['p50']:.1f}", f"{lat['p90']:.1f}",
                          f"{lat['p99']:.1f}", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "—",
                          f"{srv['mean_queue_ms']:.1f}" if srv.get("mean_queue_ms") is not None else "—",
                          f"{srv['mean_compute_ms_per_batch']:.1f}" if srv else "—", f"{srv['mean_batch_size']:.1f}" if srv else "—")
            console.print(f"[dim]{s['mode']} {level:g}: {s['throughput_rps']:.0f} req/s, p99 {lat['p99']:.1f} ms[/dim]")

        report = asyncio.run(run_loadtest(url, model, concurrency=parse_int_list(concurrency, "--concurrency"), rate=rates,
                                          distribution=distribution, duration=duration, warmup=warmup, max_requests=max_requests,
                                          binary=not json_body, batch=batch, image=image, api_key=api_key_from_env(api_key), on_step=add))
        console.print(table)
        if json_out:
            write_json_atomic(json_out, report)
            console.print(f"figures written to {json_out}")

    run_cli(go)


@app.command()
def package(
    source: Annotated[Path, typer.Argument(help="a run directory of `servopt optimize`, or an .onnx / .xml file")],
    out: Annotated[Path, typer.Option(help="the folder to create")],
    target: Annotated[str | None, typer.Option(help="package the variant recommended for this target")] = None,
    variant: Annotated[str | None, typer.Option(help="package this variant")] = None,
    name: Annotated[str | None, typer.Option(help="model name (default: the file stem)")] = None,
    max_batch: Annotated[int, typer.Option(help="batching setting recorded in the manifest")] = 32,
    max_delay_us: Annotated[int, typer.Option(help="batching setting recorded in the manifest")] = 2000,
    max_queue: Annotated[int, typer.Option(help="queue limit recorded in the manifest")] = 256,
) -> None:
    """A deployable folder: artifact, manifest, minimal requirements.txt, Dockerfile, footprint comparison."""

    def go() -> None:
        from servopt.serve.package import package as make_package

        model = _served(source, target, variant, name, None, None, None, None, None)
        result = make_package(model, out, {"max_batch": max_batch, "max_delay_us": max_delay_us, "max_queue": max_queue})
        fp = result["footprint"]
        console.print(f"packaged [bold]{model.name}[/bold] into {out}: {', '.join(result['files'])}")
        console.print(f"installed size: serving env ({', '.join(fp['serving_env']['packages'][-1:])}) {fp['serving_env']['installed_mb']} MB "
                      f"vs PyTorch env {fp['pytorch_env']['installed_mb']} MB ({fp['pytorch_over_serving']}× larger)")
        console.print_json(json.dumps(fp))

    run_cli(go)
