#!/usr/bin/env bash
# Run a command on an emulated AVX2 CPU without VNNI (qemu's EPYC-Milan: Zen 3, the seed's cpu-server class), so ONNX
# Runtime and OpenVINO pick the kernels they pick there, on any x86 host. Needs qemu-user >= 7.2 (TCG's AVX2):
#
#   apt-get install qemu-user
#   benchmarks/avx2_cpu.sh .venv/bin/python benchmarks/avx2_quality.py runs/demo
#   benchmarks/avx2_cpu.sh .venv/bin/python -m pytest -m isa
#
# What it answers: what the kernels *compute* there (MLAS's U8S8 GEMM summing pairs into a saturating int16, its NCHWc
# block of 8 floats, not 16), numerically as on the real CPU. What it cannot: speed (emulation is 20-60x slower, and
# unevenly so). Child processes run under qemu too only where binfmt_misc sends x86-64 binaries to it, which it does
# not by default. The libraries read CPUID, which qemu answers; servopt reads /proc/cpuinfo, which qemu-user leaves
# the host's, so a private mount namespace shows it the host's file less the AVX-512, VNNI and AMX flags (root needed;
# elsewhere servopt is told instead: SERVOPT_CPU_READ_AS=avx2).
set -euo pipefail
command -v qemu-x86_64 >/dev/null || { echo "avx2_cpu.sh: qemu-x86_64 not found; install it: apt-get install qemu-user" >&2; exit 2; }
exe=$(command -v "$1") || { echo "avx2_cpu.sh: $1: no such command" >&2; exit 2; }
shift
cpuinfo=$(mktemp)
trap 'rm -f "$cpuinfo"' EXIT
sed -E -e '/^flags/ s/ (avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni|gfni)\b//g' \
       -e 's/^(model name\s*:).*/\1 AMD EPYC-Milan (qemu TCG: AVX2, FMA, no AVX-512, no VNNI)/' /proc/cpuinfo > "$cpuinfo"
# TCG lists each Milan feature it does not model (none of them an instruction the kernels use): kept out of the log.
run=(qemu-x86_64 -cpu EPYC-Milan "$exe" "$@")
if unshare -m true 2>/dev/null; then
  unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$cpuinfo" "${run[@]}" \
    2> >(grep -v "TCG doesn't support requested feature" >&2)
else
  SERVOPT_CPU_READ_AS=avx2 "${run[@]}" 2> >(grep -v "TCG doesn't support requested feature" >&2)
fi
