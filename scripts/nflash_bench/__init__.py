"""The library of the benchmark drivers scripts/bench.py, bench_offload.py and
bench_scale.py (each of those parses its flags and calls the named steps of
its module here). Import it with scripts/ on sys.path.

Shared pieces, lowest first (each imports only the ones above it):
    common    repository root, log/die, number formatting, medians, run info
    proc      running a process with its wall time and rusage; idle-CPU checks
    worker    the llama-cpp-python jobs, run as `python worker.py _llama-run ...`
    llama     native llama.cpp (llama-completion) command and timing lines; GGUF tensor types
    prompt    the fixed prompt text, cut to a token count
    models    model preparation with caching (requantized GGUFs, nflash packs)
    disk      `nflash probe`, random-read bandwidth by block size, read-ahead
    cgroup    cgroup v1 memory groups: root check, one run in a fresh group
    engines   nflash / llama.cpp runs in cgroups and their outcomes
    stats     medians per engine and limit, the I/O floor
    table     plain-text tables
One module per benchmark holds its own steps:
    baseline  scripts/bench.py         nflash vs llama.cpp, prefill and decode
    offload   scripts/bench_offload.py the same under cgroup memory limits
    scale     scripts/bench_scale.py   7B synthetic ReLU models under limits
"""
