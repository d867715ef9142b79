#!/usr/bin/env bash
# Issue 40's slow machine: run CMD beside one busy process pinned on each core, the busy processes in one session of
# their own (a neighbouring program), so every thread of CMD gets about half a core.
#
#   benchmarks/slow_machine.sh servopt demo --out runs/slow
#
# Why a session of their own: with kernel autogroups (sched_autogroup_enabled=1, most distributions) or cgroups
# (systemd services, containers) a program's niceness orders only its own threads. `servopt serve` runs its inference
# threads at niceness 5 (the event loop ahead of them: refusals at 2x overload in a median of 1.5-3 ms, 8-20 ms
# without), which beside busy loops in the *same* session gave inference a quarter of each core (served compute 29-34
# ms against 14-17 ms at niceness 0; 2026-11-29, AMD EPYC Zen 4): a machine four times slower for the model, not two.
# Each busy loop in a session of its own is wrong the other way: two groups of one thread each outweigh the command's
# one group on both cores, and its two-thread work ran a third of each core (torch MobileNetV2, batch 32: 8.0 img/s on
# two threads against 32 quiet). Both loops in one session: 14.4 img/s on two threads (2.2x slower than quiet), 13.5 on
# one (19.6 quiet: 1.45x; a one-thread program gets two thirds of its core).
set -euo pipefail
setsid bash -c 'for c in $(seq 0 $(($(nproc) - 1))); do taskset -c "$c" sh -c "while :; do :; done" & done; wait' &
leader=$!
trap 'pkill -s "$(ps -o sid= -p $leader | tr -d " ")" 2>/dev/null || true' EXIT
sleep 0.3
echo "slow machine: $(nproc) busy processes in session $(ps -o sid= -p $leader | tr -d ' ') ($(cat /proc/$leader/autogroup 2>/dev/null || echo 'no autogroup'))" >&2
"$@"
