"""``servopt compare``: the peers' answers for a run's model and data, measured side by side with the run's pick.

Reads the run directory (``rundir``: the config, the records, the data the run built and judged on, the original's
outputs), builds each available peer's answer in its own process and environment (``jobs.PeerBuildJob``), measures
the pick and the answers round by round (``runner``), and writes ``compare.json`` (a ``Comparison``); the run's
report then shows it ("Against the tools you would use instead").
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servopt.bench.jobs import JobBase, MeasureJob, OpenSpec
from servopt.bench.protocol import Protocol
from servopt.contracts import Artifact, Measured, Record
from servopt.errors import UserError
from servopt.families.base import Family, family_of
from servopt.optimize.rundir import RunConfig, RunDir, load_config, load_run
from servopt.peers.base import PEERS, Peer, PeerAnswer, PeerInputs
from servopt.peers.contracts import Comparison, PeerResult
from servopt.peers.jobs import PeerBuildJob, PeerBuilt
from servopt.peers.runner import Measure, launch_measure, ratios, run_rounds
from servopt.peers.scenario import SCENARIOS, Scenario
from servopt.peers.scenarios import served as served_scenarios
from servopt.peers.scenarios import texts as texts_scenarios
from servopt.results import write_json_atomic

DEFAULT_SCENARIOS = ("single", "offline")
# pip's per-package lines while a peer's environment is made: not shown (a failure's error carries pip's output)
PIP_CHATTER = ("WARNING: Location", "Processing ", "Collecting ", "Looking in", "Downloading ", "  ", "Requirement already", "INFO: pip")


def _resolve(path: str, run: RunDir) -> str:
    """A stored artifact path made absolute: as written, else relative to the run directory."""
    p = Path(path)
    for candidate in (p, run.root / p):
        if candidate.exists():
            return str(candidate.resolve())
    raise UserError(f"the run's model file {path} is not there any more",
                    fix="run servopt compare from the folder servopt optimize ran in, or give optimize an absolute model path")


def pick_for(config: RunConfig, summary, records: list[Record], target: str | None) -> tuple[str, Record, str]:
    """(target, the record compared with, a note): the target's pick; where no target has one, the nearest miss (said)."""
    if target is not None:
        d = summary.decision(target)
        if d is None:
            raise UserError(f"the run has no target {target!r}", fix=f"use one of: {', '.join(t.name for t in config.targets)}")
    else:
        d = next((d for d in summary.targets if d.recommended), None) or next((d for d in summary.targets if d.nearest), None)
        if d is None:
            raise UserError("no target of this run has a pick or a nearest variant to compare with",
                            fix="optimize again: the run has no measured candidate")
    name = d.pick
    if name is None:
        raise UserError(f"target {d.target.name!r} has no pick nor nearest variant in this run ({d.status}: {d.reason})",
                        fix="compare on another target (--target)")
    note = "" if d.recommended else f"no variant met every bound of {d.target.name} ({d.shortfall or d.status}): its nearest miss"
    rec = next((r for r in records if r.name == name and r.status == "ok" and r.artifact is not None), None)
    if rec is None:
        raise UserError(f"the pick {name} of {d.target.name} has no measured artifact in this run",
                        fix="optimize again into the same folder (it resumes)")
    return d.target.name, rec, note


def peer_inputs(run: RunDir, config: RunConfig, records: list[Record], original: Record, name: str, quick: bool,
                isa: str | None = None) -> PeerInputs:
    """The same model and data for every peer: the run's original, its fp32 ONNX file, its calibration and tuning sets."""
    assert original.artifact is not None
    source = original.artifact
    if source.path:
        source = source.model_copy(update={"path": _resolve(source.path, run)})
    fp32 = source if source.format == "onnx" else next(
        (r.artifact for r in records if r.name == "ort-fp32" and r.status == "ok" and r.artifact and r.artifact.path), None)
    onnx = (fp32.path if fp32 is source else _resolve(fp32.path, run)) if fp32 is not None and fp32.path else None
    calib, tune = run.saved_data("calib"), run.saved_data("tune")
    return PeerInputs(peer=name, run_dir=str(run.root), family=config.spec.family_name, spec=config.spec, original=source,
                      onnx=onnx, calibration=str(calib) if calib.exists() else None,
                      tuning=str(tune) if tune.exists() else None, evaluation=str(run.eval_data),
                      out=str(run.work_root / "compare" / name / "build"), quick=quick, isa=isa)


def build_key(peer: Peer, inputs: PeerInputs, env_key: str | None) -> str:
    """What a peer's answer depends on: the peer's own source, its environment, its inputs and the files they name (size
    and modification time). The same key: the answer built before is reused (an auto-tuning search takes minutes)."""
    import hashlib
    import inspect

    h = hashlib.sha256()
    h.update(inspect.getsource(type(peer)).encode())
    h.update(f"{env_key}\0{inputs.model_dump_json()}".encode())
    for f in (inputs.onnx, inputs.original.path, inputs.calibration, inputs.tuning):
        if f and Path(f).exists():
            st = Path(f).stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def in_env(job: JobBase, ready) -> JobBase:
    """``job`` run by a peer's environment (``envs.ReadyEnv``: made once by ``ensure_env``) with servopt's source on its
    path."""
    from servopt.envs import servopt_src

    return job.model_copy(update={"python": str(ready.python), "env": {
        **job.env, "PYTHONPATH": str(servopt_src()), "PYTHONNOUSERSITE": "1", "VIRTUAL_ENV": str(ready.folder)}})


def build_peer(peer: Peer, inputs: PeerInputs, workdir: Path, progress: Callable[[str], None]) -> PeerBuilt | str:
    """The peer's answer (or why it is unavailable), built in a fresh process in its environment, or the one built before
    from the same inputs (``build_key``); a string: why it failed."""
    from servopt.bench.launcher import launch
    from servopt.envs import EnvCreationError, ensure_env

    job: JobBase = PeerBuildJob(inputs=inputs)
    spec = peer.environment()
    if spec is not None:
        progress(f"{peer.name}: making its environment {spec.name} (once)")
        try:
            ready = ensure_env(spec, lambda line: progress(line) if not line.startswith(PIP_CHATTER) else None)
        except EnvCreationError as e:
            return PeerBuilt(unavailable=f"its environment could not be made here: {e.problem}")
        job = in_env(job, ready)
    key = build_key(peer, inputs, spec.key() if spec is not None else None)
    stored = workdir / "answer.json"
    if stored.exists():
        before = PeerBuilt.model_validate_json(stored.read_text())
        path = before.answer.artifact.path if before.answer else None
        if before.key == key and before.answer is not None and (path is None or Path(path).exists()):
            progress(f"{peer.name}: its answer built before from the same inputs")
            return before.model_copy(update={"reused": True})
    progress(f"{peer.name}: building its answer")
    launched = launch(job, workdir)
    if launched.result is None:
        return f"its build failed: {launched.error}"
    built = launched.result.model_copy(update={"key": key})  # type: ignore[union-attr]
    if built.answer is not None:
        write_json_atomic(stored, built)
    return built


def built_answer(run_dir: Path, name: str, progress: Callable[[str], None] = lambda _m: None
                 ) -> tuple[Peer, PeerAnswer, PeerInputs, Path]:
    """(the peer, its answer for the run, its inputs, its environment's interpreter): built, or reused, as ``compare``
    builds it; what a benchmark that serves or times a peer outside a comparison starts from."""
    run, config = RunDir(run_dir), load_config(run_dir)
    summary, records = load_run(run_dir)
    original = next((r for r in records if summary is not None and r.name == summary.reference), None)
    if config is None or original is None:
        raise UserError(f"{run_dir} is not a finished run", fix="run the same servopt optimize again (it resumes)")
    peer = PEERS.get(name)
    inputs = peer_inputs(run, config, records, original, name, quick=False)
    ok, why = peer.available(inputs)
    if not ok:
        raise UserError(f"{name} cannot run here: {why}", fix=f"servopt compare {run_dir} --list names the peers")
    built = build_peer(peer, inputs, run.work_root / "compare" / name / "build-job", progress)
    if isinstance(built, str) or built.answer is None:
        raise UserError(f"{name}'s build: {built if isinstance(built, str) else built.unavailable}",
                        fix=f"see {run.work_root / 'compare' / name / 'build-job'}")
    return peer, built.answer, inputs, _python(peer)


def _words(family: Family, name: str, runtime: str, m: Measured | None, original: Record) -> tuple[str, float | None]:
    if m is None or m.quality is None:
        return "", None
    rec = Record(name=name, runtime=runtime, status="ok", quality=m.quality)
    return family.describe_quality(rec), family.quality_drop(rec, original)


def compare(out: Path, peers: list[str], *, target: str | None = None, rounds: int = 3, quick: bool = False,
            scenarios: list[str] | None = None, measure: Measure = launch_measure, served_s: float | None = None,
            progress: Callable[[str], None] = lambda _m: None, texts_measure: Measure = launch_measure) -> Comparison:
    """Build, measure, compare; write ``compare.json`` and return it."""
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: at least one round is needed", fix="give --rounds 3 or more (an interval needs rounds)")
    run = RunDir(out)
    summary, records = load_run(out)
    config = load_config(out)
    if summary is None or config is None:
        raise UserError(f"{out} has no summary.json: the run did not finish", fix="run the same servopt optimize again (it resumes)")
    if not peers:
        raise UserError("no peers asked for", fix=f"give --peers with some of: {', '.join(PEERS.names())}")
    for name in peers:
        PEERS.get(name)  # an unknown name: the error lists the known ones
    wanted = list(scenarios or DEFAULT_SCENARIOS)
    if scenarios is None and any(PEERS.get(n).serves for n in peers):  # a peer that serves: its served figures too
        wanted += served_scenarios.SERVED
    if (scenarios is None and config.spec.family_name in texts_scenarios.FAMILIES
            and any(PEERS.get(n).encodes for n in peers)):  # a peer with a text path of its own: texts in, end to end
        wanted += texts_scenarios.TEXTS
    scs = [SCENARIOS.get(s) for s in wanted]
    served_scs = [s for s in scs if getattr(s, "served", False)]
    texts_scs = [s for s in scs if getattr(s, "texts", False)]
    offline_scs = [s for s in scs if s not in served_scs and s not in texts_scs]
    target_name, pick, pick_note = pick_for(config, summary, records, target)
    original = next((r for r in records if r.name == summary.reference), None)
    if original is None or original.artifact is None:
        raise UserError("the run's original has no record", fix="optimize again into the same folder (it resumes)")
    family = family_of(config.spec)
    isa = next((str(t.isa) for t in config.targets if t.name == target_name and t.isa is not None), None)

    results: dict[str, PeerResult] = {}
    answers = {}
    inputs_of: dict[str, PeerInputs] = {}
    for name in dict.fromkeys(peers):
        peer = PEERS.get(name)
        inputs = peer_inputs(run, config, records, original, name, quick, isa)
        ok, why = peer.available(inputs)
        if not ok:
            results[name] = PeerResult(name=name, status="unavailable", why=why, description=peer.description)
            progress(f"{name}: not available here ({why})")
            continue
        built = build_peer(peer, inputs, run.work_root / "compare" / name / "build-job", progress)
        if isinstance(built, str) or built.answer is None:
            why = built if isinstance(built, str) else built.unavailable or "no answer"
            status = "failed" if isinstance(built, str) else "unavailable"
            results[name] = PeerResult(name=name, status=status, why=why, description=peer.description)
            progress(f"{name}: {status} ({why})")
            continue
        answers[name] = built.answer
        inputs_of[name] = inputs
        results[name] = PeerResult(name=name, status="ok", description=peer.description, reused_build=built.reused,
                                   configuration=built.answer.configuration,
                                   artifact=built.answer.artifact, runtime=built.answer.runtime, options=built.answer.options,
                                   build_s=built.answer.build_s, size_mb=_size_mb(built.answer.artifact))

    base = Protocol.quick() if quick else Protocol.model_validate(config.protocol)
    proto = base.model_copy(update={"cold_start": False, "grid": [], "length_batching": False, "sweep": [], "axes_only": False})
    for sc in offline_scs:
        proto = sc.protocol(proto)
    common = {"data": str(run.eval_data), "family": config.spec.family_name, "protocol": proto,
              "reference": str(run.reference_outputs()) if run.reference_outputs().exists() else None}
    pick_key = f"servopt:{pick.name}"
    jobs = {pick_key: MeasureJob(session=OpenSpec.of(pick, pick.artifact.opened()), env=pick.env, **common)}
    for name, answer in answers.items():
        if not answer.offline:
            continue  # served only: its tool's server is its answer
        jobs[name] = MeasureJob(session=OpenSpec(name=name, artifact=answer.artifact, runtime=answer.runtime, options=answer.options),
                                **common)
    measured = run_rounds(jobs, rounds, run.work_root / "compare" / "rounds", measure, progress)
    if pick_key in measured.failed:
        raise UserError(f"the pick {pick.name} could not be measured: {measured.failed[pick_key]}",
                        fix="see the job's log under work/compare/rounds/ (replay.sh re-runs it alone)")

    def first(name: str) -> Measured | None:
        return next((m for m in measured.measured.get(name, []) if m is not None), None)

    pick_m = first(pick_key)
    pick_text, pick_drop = _words(family, pick.name, pick.runtime, pick_m, original)
    for name in answers:
        if name in measured.failed:
            results[name] = results[name].model_copy(update={"status": "failed", "why": f"its measurement failed: {measured.failed[name]}"})
            continue
        m = first(name)
        text, drop = _words(family, name, answers[name].runtime, m, original)
        results[name] = results[name].model_copy(update={
            "quality": m.quality if m else None, "quality_text": text, "quality_drop": drop,
            "ratios": ratios(measured, pick_key, name, offline_scs) if name in jobs else [],
            "flagged_rounds": measured.flagged(name) if name in jobs else 0,
            "session": m.environment.session if m and m.environment else None})
    if texts_scs:
        encoding = [n for n in answers if PEERS.get(n).encodes and results[n].status == "ok"]
        for name, update in texts_rounds(run, config, pick, pick_key, encoding, answers, inputs_of, texts_scs, rounds, proto,
                                         texts_measure, progress, functools.partial(_served_quality, family, run, original)).items():
            results[name] = results[name].model_copy(update={**update, "ratios": [*results[name].ratios, *update.get("ratios", [])]})
    if served_scs:
        served = [n for n in answers if PEERS.get(n).serves and results[n].status == "ok"]
        for name, update in serve_rounds(run.root, target_name, bool(pick_note), pick_key, served, answers, inputs_of,
                                         served_scs, rounds, run.work_root / "compare" / "served", quick, progress,
                                         served_s, functools.partial(_served_quality, family, run, original)).items():
            results[name] = results[name].model_copy(update={**update, "ratios": [*results[name].ratios, *update.get("ratios", [])]})
    comparison = Comparison(
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), run_dir=str(run.root), target=target_name,
        pick=pick.name, pick_note=pick_note, pick_quality_text=pick_text, pick_quality_drop=pick_drop,
        pick_session=pick_m.environment.session if pick_m and pick_m.environment else None,
        scenarios=[s.name for s in scs], rounds=len(measured.order),
        order=[[pick.name if n == pick_key else n for n in o] for o in measured.order], noisy_rounds=measured.noisy_rounds(),
        quick=quick, peers=[results[n] for n in dict.fromkeys(peers)],
        environment=pick_m.environment if pick_m else None)
    write_json_atomic(run.compare, comparison)
    return comparison


def _served_quality(family: Family, run: RunDir, original: Record, name: str, embeddings: list[list[float]]) -> dict:
    """A served answer's quality, judged by the family as the offline answers are: its embeddings against the original's
    outputs on the run's evaluation samples."""
    import numpy as np

    from servopt.data.dataset import Dataset

    reference = np.load(run.reference_outputs()) if run.reference_outputs().exists() else None
    quality = family.judge(np.asarray(embeddings, dtype=np.float32), Dataset.load(run.eval_data), reference)
    m = Measured(quality=quality)
    text, drop = _words(family, name, "served", m, original)
    return {"quality": m.quality, "quality_text": text, "quality_drop": drop}


def texts_rounds(run: RunDir, config: RunConfig, pick: Record, pick_key: str, encoding: list[str],
                 answers: dict[str, PeerAnswer], inputs_of: dict[str, PeerInputs], scenarios: list[Scenario], rounds: int,
                 proto: Protocol, measure: Measure, progress: Callable[[str], None],
                 judge: Callable[[str, Any], dict]) -> dict[str, dict]:
    """The texts scenarios: servopt's pick through servopt's text path and each peer through its own (``Peer.encoder``, in
    its environment), the run's evaluation texts in, a fresh process per measurement, the order flipped each round;
    per peer, its texts ratios and what ran (the quality of its embeddings of the texts, and the pick's). A peer whose
    text path fails keeps its other figures, and says why."""
    import numpy as np

    from servopt.envs import ensure_env

    if not encoding:
        return {}
    tokenizer = (config.spec.preprocessing or {}).get("tokenizer")
    texts = served_scenarios.eval_texts(Path(tokenizer), run.eval_data) if tokenizer else None
    if not texts:
        why = "the run's evaluation texts could not be read back (its model records no tokenizer.json to decode them)"
        return {n: {"configuration": {**answers[n].configuration, "texts_not_measured": why}} for n in encoding}
    workdir = run.work_root / "compare" / "texts"
    workdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(workdir / "texts.json", texts)
    common = {"texts": str(workdir / "texts.json"), "batch_size": max(1, proto.batch_size), "protocol": proto,
              "save_embeddings": ""}
    jobs: dict[str, JobBase] = {pick_key: texts_scenarios.TextsJob(
        session=OpenSpec.of(pick, pick.artifact.opened()),  # type: ignore[union-attr]
        spec=config.spec, env=pick.env, **common)}
    for name in encoding:
        spec = PEERS.get(name).environment()
        job = texts_scenarios.TextsJob(peer=inputs_of[name], answer=answers[name], **common)
        jobs[name] = in_env(job, ensure_env(spec)) if spec is not None else job

    def measure_saving(job, wd: Path):  # each measurement saves its embeddings in its own folder
        wd.mkdir(parents=True, exist_ok=True)
        return measure(job.model_copy(update={"save_embeddings": str(wd / "embeddings.npy")}), wd)

    measured = run_rounds(jobs, rounds, workdir, measure_saving, lambda m: progress(f"texts, {m}"))  # type: ignore[arg-type]
    if pick_key in measured.failed:
        why = f"servopt's pick could not encode the texts: {measured.failed[pick_key]}"
        return {n: {"configuration": {**answers[n].configuration, "texts_not_measured": why}} for n in encoding}

    def described(name: str) -> tuple[str, str, float | None]:
        first = next((m for m in measured.measured[name] if m is not None), None)
        if first is None or not first.embeddings:
            return "", "", None
        return first.through, judge(name, np.load(first.embeddings)).get("quality_text", ""), first.load_s

    _, pick_quality, pick_load = described(pick_key)
    out: dict[str, dict] = {}
    for name in encoding:
        conf = dict(answers[name].configuration)
        if name in measured.failed:
            out[name] = {"configuration": {**conf, "texts_not_measured": f"its text path failed: {measured.failed[name]}"}}
            continue
        through, quality, load_s = described(name)
        out[name] = {"ratios": ratios(measured, pick_key, name, scenarios),
                     "configuration": {**conf, "texts_through": through, "texts_quality": quality, "texts_load_s": load_s,
                                       "texts_pick_quality": pick_quality, "texts_pick_load_s": pick_load,
                                       "texts": f"{len(texts)} evaluation texts (their token ids decoded)"}}
    return out


def _python(peer: Peer) -> Path:
    """The interpreter of the peer's environment (made by its build already), servopt's when it has none."""
    from servopt.envs import ensure_env

    spec = peer.environment()
    return Path(ensure_env(spec).python) if spec is not None else Path(sys.executable)


def serve_rounds(run_root: Path, target: str, nearest: bool, pick_key: str, served: list[str], answers: dict[str, PeerAnswer],
                 inputs_of: dict[str, PeerInputs], scenarios: list[Scenario], rounds: int, workdir: Path, quick: bool,
                 progress: Callable[[str], None], seconds: float | None = None,
                 judge: Callable[[str, list[list[float]]], dict] | None = None) -> dict[str, dict]:
    """The served scenarios: servopt's pick under ``servopt serve`` and each serving peer under its own server, one
    server at a time, the order flipped each round (``run_rounds``); per peer, its served ratios (or why it failed).
    The request speaks the first serving peer's API (``servopt serve`` answers both). A peer's server also embeds the
    run's evaluation texts once (``judge``: its quality against the original, as the offline answers are judged)."""
    if not served:
        return {}
    api = PEERS.get(served[0]).serves or "oip-v2"
    jobs = {pick_key: served_scenarios.ServedJob(pick_key, functools.partial(served_scenarios.pick_server, run_root, target, nearest, api))}
    for name in served:
        peer = PEERS.get(name)
        ref = inputs_of[name].original.ref
        texts = served_scenarios.eval_texts(ref.path, Path(inputs_of[name].evaluation)) if ref is not None else None
        jobs[name] = served_scenarios.ServedJob(name, functools.partial(peer.serve, inputs_of[name], answers[name], _python(peer)),
                                                texts=texts)
    step_s, warmup = (2.0, 0.5) if quick else (10.0, 2.0)
    step_s = seconds or step_s  # each load step's length
    measured = run_rounds(jobs, rounds, workdir, functools.partial(served_scenarios.measure, seconds=step_s, warmup=min(warmup, step_s)),  # type: ignore[arg-type]
                          lambda m: progress(f"served, {m}"))
    if pick_key in measured.failed:
        why = f"servopt's pick could not be served: {measured.failed[pick_key]}"
        return {n: {"status": "failed", "why": why} for n in served}
    out: dict[str, dict] = {}
    for name in served:
        if name in measured.failed:
            out[name] = {"status": "failed", "why": f"its served measurement failed: {measured.failed[name]}"}
            continue
        first = next((m for m in measured.measured[name] if m is not None), None)
        starts = {k: [m.start_s for m in measured.measured[k] if m is not None and m.start_s is not None] for k in (pick_key, name)}
        judged = judge(name, first.embeddings) if judge is not None and first is not None and first.embeddings else {}
        out[name] = {"ratios": ratios(measured, pick_key, name, scenarios),
                     "configuration": {**answers[name].configuration,
                                       "served_by": " ".join(first.command) if first is not None and first.command else None,
                                       "served_start_s": {"peer": statistics.median(starts[name]) if starts[name] else None,
                                                          "pick": statistics.median(starts[pick_key]) if starts[pick_key] else None},
                                       **({"served_quality": "its server's embeddings of the run's evaluation texts (its "
                                           "token ids decoded) against the original's outputs"} if judged else {}),
                                       **({"not_judged": first.embed_error} if first is not None and first.embed_error else {})},
                     **judged}
    return out


def _size_mb(artifact: Artifact) -> float | None:
    if not artifact.path or not os.path.exists(artifact.path):
        return None
    from servopt.models.sources import artifact_size_mb

    return round(artifact_size_mb(artifact), 4)
