#!/bin/bash
# CPU per random 8 KiB O_DIRECT read, all CPUs (user+nice+system+irq+softirq from /proc/stat), by fio engine.
# usage: fio_cpu.sh FILE
F=$1; IOS=${IOS:-100000}
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
run() { # name, fio args...
  local name=$1; shift
  sync; echo 3 > /proc/sys/vm/drop_caches
  local b0=$(busy) t0=$(date +%s.%N)
  fio --name=$name --filename=$F --readonly --rw=randread --bs=8k --direct=1 --number_ios=$((IOS / ${NJ:-1})) --size=100% --norandommap --randrepeat=0 --group_reporting --output-format=terse --terse-version=3 "$@" > /tmp/s5/fio-$name.txt
  local b1=$(busy) t1=$(date +%s.%N)
  local ios=$(awk -F';' '{print $6}' /tmp/s5/fio-$name.txt)  # read total I/Os? fallback
  python3 -c "b=($b1-$b0)/100.0; t=$t1-$t0; n=$IOS; print(f'$name: {n} reads in {t:.1f} s ({n/t:.0f}/s), CPU {b:.2f} s, {b/n*1e6:.1f} us per read')"
}
NJ=16 run psync-16 --ioengine=psync --numjobs=16
NJ=64 run psync-64 --ioengine=psync --numjobs=64
run uring-qd16 --ioengine=io_uring --iodepth=16
run uring-qd64 --ioengine=io_uring --iodepth=64
run libaio-qd16 --ioengine=libaio --iodepth=16
