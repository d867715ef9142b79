"""The ``serve``, ``loadtest`` and ``package`` commands (no torch imported on this path)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from servopt.cli.app import app, console, run_cli
from servopt.contracts import confirming_votes
from servopt.errors import UserError

SourceArg = Annotated[Path, typer.Argument(help="a run directory of `servopt optimize`, a package folder, an .onnx file or an OpenVINO .xml")]
TargetOpt = Annotated[str | None, typer.Option(help="serve the variant recommended for this target (run directory)")]
VariantOpt = Annotated[str | None, typer.Option(help="serve this variant of the run directory")]
NearestOpt = Annotated[bool, typer.Option("--nearest", help="when no variant meets --target, serve the nearest miss deliberately "
                                                            "(its shortfall is printed and put in the model's metadata)")]


def _served(source: Path, target: str | None, variant: str | None, nearest: bool, name: str | None, runtime: str | None,
            options: dict):
    """The model to serve, and the serving settings a package was made with (empty otherwise)."""
    from servopt.models.onnx_encoder import folder_onnx
    from servopt.serve.model import from_file, from_package, from_run

    packaged: dict = {}
    if source.is_dir() and (source / "manifest.json").exists():
        model, packaged = from_package(source)
    elif source.is_dir() and not (source / "results.jsonl").exists() and (onnx_file := folder_onnx(source)) is not None:
        if target or variant or nearest:
            raise UserError("--target/--variant/--nearest pick from a run directory", fix="pass the run directory, or drop them")
        model = from_file(onnx_file, name, runtime, options)  # an ONNX encoder folder as it is (its pooling appended)
    elif source.is_dir():
        model = from_run(source, target, variant, nearest)
        packaged = dict(model.found_settings)  # the target's capacity search: under the flags, like a package's
    else:
        if target or variant or nearest:
            raise UserError("--target/--variant/--nearest pick from a run directory", fix="pass the run directory, or drop them")
        model = from_file(source, name, runtime, options)
    if name:
        model.name = name
    return model, packaged


def serve_settings(packaged: dict, **given):
    """Command line over ``SERVOPT_*`` variables over a package's settings over the defaults."""
    from pydantic import ValidationError

    from servopt.settings import ServeSettings

    from_package = {k: v for k, v in packaged.items() if f"SERVOPT_{k.upper()}" not in os.environ and v is not None}
    try:
        return ServeSettings(**{**from_package, **{k: v for k, v in given.items() if v is not None}})
    except ValidationError as e:
        first = e.errors()[0]
        name = ".".join(map(str, first["loc"]))
        raise UserError(f"serving setting {name} = {first.get('input')!r}: {first['msg']}",
                        fix=f"correct --{name.replace('_', '-')} (or SERVOPT_{name.upper()}, or the package's manifest)") from None


@app.command()
def serve(
    source: SourceArg,
    target: TargetOpt = None,
    variant: VariantOpt = None,
    nearest: NearestOpt = False,
    name: Annotated[str | None, typer.Option(help="model name in URLs (default: the file stem)")] = None,
    host: Annotated[str | None, typer.Option(help="address to bind; 127.0.0.1 unless you mean to expose it [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [default: 8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="also serve the OIP v2 gRPC service on this port (off unless given)")] = None,
    max_batch: Annotated[int | None, typer.Option(help="largest merged batch [default: 32]")] = None,
    max_call_tokens: Annotated[int | None, typer.Option(
        help="text models on a CPU: padded tokens past which a model call stops merging requests; 0: no such bound "
             "[default: 512]")] = None,
    max_padding: Annotated[float | None, typer.Option(
        help="text models: a merged batch is split into model calls that pad at most this share of their tokens "
             "[default: 0.25]")] = None,
    max_delay_us: Annotated[int | None, typer.Option(help="how long a request may wait to be batched, µs [default: 2000]")] = None,
    max_queue: Annotated[int | None, typer.Option(help="samples allowed to wait; past it 503 + Retry-After, a request of more "
                                                     "samples 413 [default: 256]")] = None,
    latency_budget_ms: Annotated[float | None, typer.Option(
        help="the longest a request may wait for its model call: one expected to wait longer is refused at once (503 + "
             "Retry-After), a queued one past it dropped (503); 0: no bound but --max-queue [default: 1000]")] = None,
    no_batching: Annotated[bool, typer.Option("--no-batching", help="run each request alone")] = False,
    instances: Annotated[int | None, typer.Option(
        help="model instances (sessions) serving the queue (default: 2 single-thread instances for a throughput "
             "target of a run directory, else 1)")] = None,
    timeout: Annotated[float | None, typer.Option(help="per-request timeout, s (504 past it) [default: 30]")] = None,
    max_body_mb: Annotated[float | None, typer.Option(help="request size limit (413 past it) [default: 32]")] = None,
    limit_concurrency: Annotated[int | None, typer.Option(
        help="uvicorn's limit on connections + requests in progress (503 at header time); idle keep-alive "
             "connections count too. Default: none (the bounded queue refuses instead)")] = None,
    api_key: Annotated[str | None, typer.Option(help="require 'Authorization: Bearer KEY' (or set SERVOPT_API_KEY)")] = None,
    runtime: Annotated[str | None, typer.Option(help="onnxruntime (default for .onnx) or openvino")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="runtime option KEY=VALUE (e.g. hint=THROUGHPUT)")] = None,
    threads: Annotated[int | None, typer.Option(help="intra-op threads per instance")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="serve on Ray Serve: a local Ray instance, or the cluster of --ray-address "
                                                    "(needs `pip install 'servopt\\[ray]'`)")] = False,
    ray_address: Annotated[str | None, typer.Option(help="join this Ray cluster (auto, ray://HOST:10001, …); implies --ray")] = None,
    replicas: Annotated[int | None, typer.Option(help="Ray Serve replicas, each with its own batcher (default 1)")] = None,
    autoscale: Annotated[str | None, typer.Option(
        help="Ray Serve autoscaling MIN-MAX[:TARGET] on requests in flight per replica (TARGET, default --max-batch)")] = None,
) -> None:
    """Serve a model over the Open Inference Protocol v2 (KServe/Triton; REST, and gRPC with --grpc-port) with
    dynamic batching; with --ray, as N replicas (or autoscaled) on Ray Serve."""

    def go() -> None:
        from servopt.cli.common import parse_options
        from servopt.serve.server import run_server

        on_ray = ray or ray_address is not None
        if not on_ray and (replicas is not None or autoscale is not None):
            raise UserError("--replicas and --autoscale are Ray Serve's", fix="add --ray (or --instances N for more sessions in one process)")
        if replicas is not None and autoscale is not None:
            raise UserError("--replicas and --autoscale exclude each other", fix="a fixed count, or MIN-MAX autoscaling")
        if on_ray:
            from servopt.serve.ray_serve import require_ray

            require_ray()
        model, packaged = _served(source, target, variant, nearest, name, runtime, parse_options(option))
        settings = serve_settings(packaged, host=host, port=port, grpc_port=grpc_port, max_batch=max_batch,
                                  max_call_tokens=max_call_tokens, max_padding=max_padding, max_delay_us=max_delay_us, max_queue=max_queue,
                                  latency_budget_ms=latency_budget_ms,
                                  batching=False if no_batching else None,
                                  instances=instances, threads=threads, request_timeout_s=timeout, max_body_mb=max_body_mb,
                                  api_key=api_key, limit_concurrency=limit_concurrency)
        model.apply_instances(settings.instances, settings.threads)
        if model.found_settings:
            cap = model.found_capacity
            console.print(f"[dim]serving configuration from the run's capacity search ({cap.capacity_rps:.0f} requests/s within "
                          f"{cap.slo} on {cap.cores} core(s) there), scaled to this machine's cores; flags override it[/dim]")
        if model.parameters.get("served_as") == "nearest candidate":
            console.print(f"[yellow]no variant meets target {model.parameters['target']}: serving the nearest, "
                          f"{model.parameters['variant']}, deliberately; shortfall: {model.parameters['shortfall']}[/yellow]")
        grpc = f"; gRPC on {settings.host}:{settings.grpc_port}" if settings.grpc_port else ""
        scaling, scale = "", None
        if on_ray:
            from servopt.serve.ray_serve import check_settings, parse_autoscale, run_ray_server

            check_settings(settings)
            scale = parse_autoscale(autoscale, settings.max_batch) if autoscale else None
            if scale:
                how = (f"autoscaling {scale['min_replicas']}-{scale['max_replicas']} replicas, "
                       f"target {scale['target_ongoing_requests']:g} requests in flight each")
            else:
                how = f"{replicas or 1} replica(s)"
            scaling = f" on Ray Serve ({how}, {f'cluster {ray_address}' if ray_address else 'local Ray'})"
        console.print(f"serving [bold]{model.name}[/bold] ({model.artifact.format} on {model.runtime}, {model.instances} instance(s)"
                      f"{' + one on every core for lone calls' if model.solo_options is not None else ''}"
                      f"{' per replica' if on_ray else ''}){scaling} at http://{settings.host}:{settings.port}/v2/models/{model.name}{grpc}; "
                      f"batching: {'off' if not settings.batching else f'max {settings.max_batch}, {settings.max_delay_us} µs'}; "
                      f"latency budget: {f'{settings.latency_budget_ms:g} ms' if settings.latency_budget_ms else 'none'}; "
                      f"auth: {'bearer token' if settings.api_key else 'none'}")
        if on_ray:
            run_ray_server({model.name: model}, settings, replicas=replicas or 1, autoscale=scale, address=ray_address)
        else:
            run_server({model.name: model}, settings)

    run_cli(go)


DEFAULT_DURATION = 20.0


def _capacity(url: str, model: str, slo_text: str, rate: str | None, duration: float, min_queries: int, api_key: str | None,
              json_out: Path | None, duration_given: bool, image: Path | None, texts: Path | None, sender: str,
              claim: bool = False, max_rate: float | None = None) -> None:
    """``servopt loadtest --slo``: the capacity search (``serve.ratesearch``), its steps as a table."""
    from servopt.results import write_json_atomic
    from servopt.serve.load.requests import image_files
    from servopt.serve.ratesearch import SearchRules, measure_capacity, parse_slo

    bound = parse_slo(slo_text)
    if not url.startswith(("http://", "https://")):
        raise UserError(f"{url!r} is not an http(s) URL", fix="e.g. http://127.0.0.1:8000")
    try:
        start = float(rate.split(",")[0]) if rate else 10.0
    except ValueError as e:
        raise UserError(f"--rate {rate!r} is not a number", fix="e.g. --rate 100 (where the search starts)") from e
    if start <= 0:
        raise UserError("--rate must be positive", fix="e.g. --rate 100")
    if max_rate is not None and max_rate < start:
        raise UserError(f"--max-rate {max_rate:g} is below where the search starts ({start:g}/s)",
                        fix="raise --max-rate or lower --rate")
    seconds = duration if duration_given else 3.0
    # a long confirming run: near the knee a queue builds for seconds that short steps do not see (docs/serving.md)
    rules = SearchRules(min_seconds=seconds, min_queries=min_queries, confirm_seconds=4 * seconds, confirm_queries=4 * min_queries,
                        judge="claim" if claim else "percentile", **({"max_rps": max_rate} if max_rate else {}))
    table = Table(title=f"capacity of {model} at {url} within {bound}", title_style="bold")
    for col in ("offered req/s", "achieved", "requests", "p50 ms", f"p{bound.percentile} ms", "claimed", "needed", "errors",
                "client lag p99", "valid", "meets"):
        table.add_column(col, justify="right")

    def ms(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "—"

    def show(st) -> None:
        console.print(f"[dim]{'confirming ' if st.confirming else ''}{st.rate_rps:.1f} req/s: p50 {ms(st.p50_ms)} ms, "
                      f"p99 {ms(st.p99_ms)} ms, claimed {ms(st.claim_ms)} ms ({st.requests} queries, {st.needed} needed for the claim), "
                      f"{st.errors} errors → {'meets' if st.meets else 'misses'} {bound}"
                      f"{'' if st.valid else ' (not valid: ' + (st.invalid or '') + ')'}[/dim]")
        table.add_row(f"{st.rate_rps:.1f}{' (confirm)' if st.confirming else ''}", f"{st.achieved_rps:.1f}", str(st.requests),
                      ms(st.p50_ms), ms(st.p99_ms), ms(st.claim_ms), str(st.needed), str(st.errors), ms(st.lag_p99_ms),
                      "yes" if st.valid else "[red]no[/red]", "[green]yes[/green]" if st.meets else "[red]no[/red]")

    files = image_files(image) if image else None
    result, what = measure_capacity(url, model, bound, start, rules, api_key, on_step=show, images=files, sender=sender,
                                    texts=texts)
    console.print(table)
    verdict = (f"LoadGen's early-stopping rule claims its p{bound.percentile} within the bound" if claim else
               f"its plain p{bound.percentile} is within the bound (a confirming run: within {1 - rules.confirm_margin:.0%} "
               "of it), over at least the queries LoadGen's early-stopping rule needs to claim it")
    console.print(f"sent: {what} (sender {sender}); latency from each request's scheduled time; a step meets when {verdict} "
                  f"({rules.step_confidence:.0%} for a step, {rules.confirm_confidence:.0%} for the confirming runs)")
    if result.confirmed:
        lower = "" if result.knee_found else " (at least: the step limit came before a failing rate)"
        knee = (f"; the short steps' knee: {result.knee_rps:.1f} requests/s, confirmed {rules.headroom:.0%} below it, where "
                "longer runs hold" if result.knee_found else "")
        held, rerun = confirming_votes(result.steps, result.capacity_rps)
        again = f"; {rerun} more not valid (the client fell behind) and run again" if rerun else ""
        console.print(f"capacity within {bound}: [bold]{result.capacity_rps:.1f} requests/s[/bold]{lower}, confirmed by "
                      f"{sum(s.meets for s in held)} of {len(held)} runs of at least {min(s.requests for s in held)} queries "
                      f"(their second halves within the bound too{again}){knee}")
    else:
        console.print(f"[red]no rate tried met {bound} with no errors[/red] (the lowest: "
                      f"{min((s.rate_rps for s in result.steps), default=start):.1f} req/s)")
    if result.stopped:
        console.print(f"the search stopped early: {result.stopped}")
    if json_out:
        write_json_atomic(json_out, {"schema": "servopt.capacity/2", "url": url, "model": model, "slo": str(bound),
                                     "requests": what, "sender": sender, **result.model_dump(mode="json")})
        console.print(f"figures written to {json_out}")


@app.command()
def loadtest(
    url: Annotated[str, typer.Argument(help="the server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="model name on the server")],
    concurrency: Annotated[str | None, typer.Option(help="closed-loop steps, e.g. 1,8,32,64")] = None,
    rate: Annotated[str | None, typer.Option(help="open-loop steps in requests/s, e.g. 100,300")] = None,
    distribution: Annotated[str, typer.Option(help="open-loop arrivals: poisson or constant")] = "poisson",
    duration: Annotated[float, typer.Option(help="seconds per step")] = 20.0,  # DEFAULT_DURATION
    warmup: Annotated[float, typer.Option(help="uncounted seconds before each step")] = 3.0,
    max_requests: Annotated[int, typer.Option(help="at most this many requests per closed-loop step")] = 1_000_000,
    json_body: Annotated[bool, typer.Option("--json-body", help="send JSON tensors instead of Triton binary tensors")] = False,
    batch: Annotated[int, typer.Option(help="samples per request")] = 1,
    image: Annotated[Path | None, typer.Option(help="send this image, or the images of this folder (one a request, drawn "
                                                    "at random), to the classify endpoint")] = None,
    texts: Annotated[Path | None, typer.Option(help="send these texts (.txt one a line, .jsonl, .csv), one a request "
                                                    "drawn at random, as OIP v2 BYTES")] = None,
    sender: Annotated[str, typer.Option(help="how requests are sent: raw (keep-alive HTTP/1.1, the cheapest), aiohttp, "
                                             "or grpc (with --grpc-url)")] = "raw",
    grpc_url: Annotated[str | None, typer.Option(help="--sender grpc: the server's gRPC address, e.g. 127.0.0.1:8001")] = None,
    api_key: Annotated[str | None, typer.Option(help="bearer token (or SERVOPT_API_KEY)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the figures to this JSON file")] = None,
    slo: Annotated[str | None, typer.Option(
        help="find the capacity: the highest Poisson rate whose latency percentile meets this bound with no errors, "
             "e.g. p99=50ms (--rate: where the search starts [default 10]; --duration: each step's minimum seconds "
             "[default 3])")] = None,
    min_queries: Annotated[int, typer.Option(help="--slo: each step's minimum query count, over what the early-stopping "
                                                  "rule asks (a confirming run: four times it)")] = 0,
    claim: Annotated[bool, typer.Option("--claim", help="--slo: a step meets on LoadGen's early-stopping claim (MLPerf's "
                                                        "stricter verdict) instead of its plain percentile")] = False,
    max_rate: Annotated[float | None, typer.Option(help="--slo: the highest rate offered (a server you must not flood, "
                                                        "or a client on the same cores): met there, the capacity is "
                                                        "'at least' it")] = None,
) -> None:
    """Load-test a v2 server: closed loop at fixed concurrencies, open loop at fixed rates, or (--slo) its capacity
    within a latency bound."""

    def go() -> None:
        from servopt.cli.common import parse_int_list
        from servopt.results import write_json_atomic
        from servopt.serve.loadtest import run_loadtest

        if sender not in ("raw", "aiohttp", "grpc"):
            raise UserError(f"unknown sender {sender!r}", fix="use raw, aiohttp or grpc")
        if sender == "grpc" and not grpc_url:
            raise UserError("--sender grpc needs the server's gRPC address", fix="add --grpc-url HOST:PORT")
        if slo is not None:
            if sender == "grpc":
                raise UserError("--slo searches over HTTP", fix="use --sender raw or aiohttp")
            _capacity(url, model, slo, rate, duration, min_queries, api_key or os.environ.get("SERVOPT_API_KEY"), json_out,
                      duration != DEFAULT_DURATION, image, texts, sender, claim, max_rate)
            return
        if not concurrency and not rate:
            raise UserError("nothing to run", fix="pass --concurrency 1,8,32 and/or --rate 100,300, or --slo p99=50ms")
        if distribution not in ("poisson", "constant"):
            raise UserError(f"unknown distribution {distribution!r}", fix="use poisson or constant")
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{url!r} is not an http(s) URL", fix="e.g. http://127.0.0.1:8000")
        rates = [float(r) for r in rate.split(",")] if rate else []
        if any(r <= 0 for r in rates):
            raise UserError("rates must be positive", fix="e.g. --rate 100,300")
        table = Table(title=f"servopt loadtest {url} ({model})", title_style="bold")
        for col in ("mode", "level", "ok", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors", "client ms/req", "valid",
                    "queue ms", "compute ms/batch", "batch"):
            table.add_column(col, justify="left" if col in ("mode", "errors") else "right")

        def num(v: float | None, digits: int = 1) -> str:
            return f"{v:.{digits}f}" if v is not None else "—"

        def add(s: dict) -> None:
            srv = s.get("server") or {}
            lat = s["latency_ms"]
            level = s["concurrency"] if s["mode"] == "closed" else s["rate_rps"]
            table.add_row(s["mode"], f"{level:g}", str(s["ok"]), f"{s['throughput_rps']:.0f}", num(lat["p50"]), num(lat["p90"]),
                          num(lat["p99"]), ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "—",
                          num(s["client"]["cpu_ms_per_request"], 2), "yes" if s["valid"] else "[red]no[/red]",
                          num(srv.get("mean_queue_ms")), num(srv.get("mean_compute_ms_per_batch")), num(srv.get("mean_batch_size")))
            console.print(f"[dim]{s['mode']} {level:g}: {s['throughput_rps']:.0f} req/s, p99 {num(lat['p99'])} ms"
                          f"{'' if s['valid'] else ' (not valid: ' + s['invalid'] + ')'}[/dim]")

        report = asyncio.run(run_loadtest(url, model, concurrency=parse_int_list(concurrency, "--concurrency"), rate=rates,
                                          distribution=distribution, duration=duration, warmup=warmup, max_requests=max_requests,
                                          binary=not json_body, batch=batch, image=image, texts=texts, sender=sender,
                                          grpc_url=grpc_url, api_key=api_key or os.environ.get("SERVOPT_API_KEY"), on_step=add))
        console.print(table)
        console.print(f"sent: {report['requests']} (sender {sender}); latency from each request's scheduled time")
        if json_out:
            write_json_atomic(json_out, report)
            console.print(f"figures written to {json_out}")

    run_cli(go)


@app.command()
def package(
    source: SourceArg,
    out: Annotated[Path, typer.Option(help="the folder to create")],
    target: TargetOpt = None,
    variant: VariantOpt = None,
    nearest: NearestOpt = False,
    name: Annotated[str | None, typer.Option(help="model name (default: the file stem)")] = None,
    max_batch: Annotated[int | None, typer.Option(help="batching setting recorded in the manifest [default: 32]")] = None,
    max_delay_us: Annotated[int | None, typer.Option(help="batching setting recorded in the manifest [default: 2000]")] = None,
    max_queue: Annotated[int | None, typer.Option(help="queue limit recorded in the manifest [default: 256]")] = None,
    latency_budget_ms: Annotated[float | None, typer.Option(help="latency budget recorded in the manifest [default: 1000]")] = None,
    instances: Annotated[int | None, typer.Option(help="model instances recorded in the manifest")] = None,
) -> None:
    """A deployable folder: artifact, manifest, minimal requirements.txt, Dockerfile, footprint comparison."""

    def go() -> None:
        from servopt.serve.package import package as make_package

        model, packaged = _served(source, target, variant, nearest, name, None, {})
        if model.found_capacity is not None and model.instance_vcpus:  # the configuration found, for the target's instance
            from servopt.serve.model import capacity_settings

            packaged = capacity_settings(model.found_capacity, model.instance_vcpus)
        settings = serve_settings(packaged, max_batch=max_batch, max_delay_us=max_delay_us, max_queue=max_queue,
                                  latency_budget_ms=latency_budget_ms, instances=instances)
        model.apply_instances(settings.instances, settings.threads)
        result = make_package(model, out, settings)
        fp = result.footprint
        console.print(f"packaged [bold]{model.name}[/bold] into {out}: {', '.join(result.files)}")
        console.print(f"installed size: serving env ({model.runtime}) {fp.serving_env.installed_mb} MB "
                      f"vs PyTorch env {fp.pytorch_env.installed_mb} MB ({fp.pytorch_over_serving}× larger)")
        console.print_json(fp.model_dump_json())

    run_cli(go)
