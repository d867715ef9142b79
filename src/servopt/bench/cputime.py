"""CPU accounting, one formula for the whole project: the machine, this process, a process tree and its threads.

``/proc/stat`` gives the whole machine's busy time (steal included), ``os.times`` this process's; the difference is
everyone else (``interference.CpuMonitor``). A server measured from outside is a process tree (uvicorn, its workers, a
runtime's helpers): its CPU is the sum of ``/proc/<pid>/stat`` over the tree, and its threads' CPU splits the event
loop from the model calls. Standard library only, so a worker in another tool's Python environment (a peer's) can
import it with servopt's source folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path


def machine_busy_s() -> tuple[float, float]:
    """(busy seconds summed over all CPUs, steal seconds) since boot; (nan, nan) where /proc is absent."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan"), float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    t = os.times()
    return t.user + t.system


def proc_cpu_ticks(stat_line: str) -> int:
    """utime + stime (clock ticks) from one ``/proc/<pid>/stat`` line; the command name may hold spaces and ')'."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after "pid (comm)"


def proc_ppid(stat_line: str) -> int:
    """The parent pid from one ``/proc/<pid>/stat`` line."""
    return int(stat_line[stat_line.rindex(")") + 2:].split()[1])


def status_kb(status_text: str, key: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmHWM``: peak resident set; ``VmRSS``); 0 when absent."""
    for line in status_text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, from /proc (just ``[pid]`` where /proc is absent)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                children.setdefault(proc_ppid((entry / "stat").read_text()), []).append(int(entry.name))
            except (OSError, ValueError):
                continue  # ended meanwhile
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants."""
    ticks = 0
    for p in process_tree(pid):
        try:
            ticks += proc_cpu_ticks(Path(f"/proc/{p}/stat").read_text())
        except OSError:
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_kb(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` memory field summed over the tree (``VmRSS`` now, ``VmHWM`` each one's peak), in kB."""
    total = 0
    for p in process_tree(pid):
        try:
            total += status_kb(Path(f"/proc/{p}/status").read_text(), key)
        except OSError:
            continue
    return total


def thread_cpu_s(pid: int, prefix: str) -> tuple[float, float]:
    """(main thread, threads whose name starts with ``prefix``) CPU seconds of process ``pid`` so far. A server's
    main thread runs its event loop; its model calls run on threads it names (``serve.batcher.INFERENCE_THREAD_PREFIX``).
    Threads of neither kind (a runtime's intra-op pool, the tokenizer's) count in neither figure."""
    main = named = 0
    task_dir = Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir() if task_dir.is_dir() else ():
        try:
            ticks, comm = proc_cpu_ticks((task / "stat").read_text()), (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if task.name == str(pid):
            main += ticks
        elif comm.startswith(prefix):
            named += ticks
    tick = os.sysconf("SC_CLK_TCK")
    return main / tick, named / tick


def threads_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of process ``pid`` so far, by thread id (empty where /proc is absent). Two
    readings a window apart say which threads burned CPU meanwhile: a runtime's helper threads as well as its callers."""
    out: dict[int, float] = {}
    task_dir = Path(f"/proc/{pid}/task")
    tick = os.sysconf("SC_CLK_TCK") if task_dir.is_dir() else 1
    for task in task_dir.iterdir() if task_dir.is_dir() else ():
        try:
            out[int(task.name)] = proc_cpu_ticks((task / "stat").read_text()) / tick
        except (OSError, ValueError):  # ended meanwhile
            continue
    return out


def busy_threads(before: dict[int, float], after: dict[int, float], wall_s: float, share: float = 0.1) -> dict[int, float]:
    """The threads that burned more than ``share`` of a core between two ``threads_cpu_s`` readings ``wall_s`` apart:
    their CPU seconds meanwhile."""
    spent = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    return {tid: s for tid, s in spent.items() if wall_s > 0 and s / wall_s > share}


def thread_cores(tid: int) -> frozenset[int] | None:
    """The cores thread ``tid`` may run on now (its affinity mask: a runtime that pins a thread narrows it), or None
    where it cannot be read (ended, or not Linux)."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except (AttributeError, OSError):
        return None
