set -u
export PATH=$PWD/target-dev/bin:$PATH LD_LIBRARY_PATH=$PWD/target-dev/lib
head -c 24 /dev/urandom | base64 > /tmp/peer-k; chmod 600 /tmp/peer-k
A=$PWD/target-dev/bin/kvnode-A; B=$PWD/target-dev/bin/kvnode-B
(date; nproc; grep -m1 "model name" /proc/cpuinfo; grep -o -w -E 'avx512f|vaes|vpclmulqdq' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; iperf3 --version | head -1) > $OUT/host.txt 2>&1
K=--daemon-arg=--cluster-key=/tmp/peer-k
PULL_ARGS="--connections 1 $K" SKIP_LOCAL=1 timeout 120 scripts/bench-abba.sh $A $B 1 > $OUT/abba-1conn.txt 2>&1; echo rc=$? >> $OUT/abba-1conn.txt
PULL_ARGS="--connections 4 $K" SKIP_LOCAL=1 timeout 230 scripts/bench-abba.sh $A $B 2 > $OUT/abba-4conn.txt 2>&1; echo rc=$? >> $OUT/abba-4conn.txt
PULL_ARGS="--connections 1" SKIP_LOCAL=1 timeout 100 scripts/bench-abba.sh $A $B 1 > $OUT/abba-keyless.txt 2>&1; echo rc=$? >> $OUT/abba-keyless.txt
tail -n 30 $OUT/*.txt
