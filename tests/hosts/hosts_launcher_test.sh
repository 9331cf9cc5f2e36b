#!/usr/bin/env bash
# Tests of `ddp-run --hosts` (scripts/ddp-hosts) with the real mpiexec: ranks land on the hosts
# asked for, with their names and addresses; TCP crosses the hosts; a capped link is slower; a
# dropped link loses every packet and comes back with its cap; a host that dies, a job past its time limit and a killed launcher all end the job and leave no
# namespace, link or process behind. Exit 77 (skipped) where test hosts cannot be made.
# Usage: hosts_launcher_test.sh <path to ddp-run> <mpiexec>
set -u
run=$1
mpiexec=$2
tool=$(dirname "$run")/ddp-hosts
"$tool" check || exit $?
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0 passed=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
ms() { echo $(($(date +%s%N) / 1000000)); }
# What a cluster leaves: namespaces, links (r<pid>br, r<pid>h<i>), state directories.
leftovers() {
  local id=$1
  {
    ip netns list | awk '{print $1}' | grep -E "^$id-h"
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$id(br|h[0-9]+)$"
    ls "${DDP_HOSTS_STATE:-/run/ddp-hosts}" 2> /dev/null | grep -E "^$id$"
  } | tr '\n' ' '
}
jobs_id() { grep -o 'DDP_HOSTS_ID=r[0-9]*' "$1" | head -1 | cut -d= -f2; }

cat > "$work/rank.sh" << 'R'
#!/usr/bin/env bash
echo "DDP_HOSTS_ID=$DDP_HOSTS_ID rank=$OMPI_COMM_WORLD_RANK host=$(hostname) DDP_HOST=$DDP_HOST addr=$DDP_HOST_ADDR"
case "${MODE:-}" in
  sleep) exec sleep 300 ;;
  kill-host)  # rank 0 kills every process of the last host, itself not among them
    if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then
      sleep 1
      "$TOOL" kill "$DDP_HOSTS_ID" "h${HOSTS}"
    fi
    exec sleep 300 ;;
esac
exit 0
R
chmod +x "$work/rank.sh"
export TOOL=$tool

# 1. 3 hosts x 2 ranks: block placement, each rank's host name (its UTS name) and address.
out=$("$run" --hosts 3 --ranks-per-host 2 --timeout 60 --mpiexec "$mpiexec" "$work/rank.sh" 2>&1)
rc=$?
echo "$out" > "$work/1.log"
id=$(jobs_id "$work/1.log")
[ $rc = 0 ] || fail "3 hosts x 2: exit $rc: $out"
for r in 0 1 2 3 4 5; do
  h=$((r / 2 + 1))
  grep -q "rank=$r host=h$h DDP_HOST=h$h addr=10.77.0.$h$" <<< "$out" || fail "rank $r is not on h$h at 10.77.0.$h: $out"
done
[ -n "$id" ] || fail "no cluster id reported: $out"
[ -z "$(leftovers "$id")" ] || fail "cluster $id left behind: $(leftovers "$id")"
ok "3 hosts x 2 ranks placed by block, named and addressed; nothing left"

# 2. --hosts-only: one process beside the hosts, which reaches one host over TCP from another.
cat > "$work/tcp.sh" << 'R'
#!/usr/bin/env bash
# A listener on h2, a client on h1: the bytes cross both hosts' links and the bridge.
"$TOOL" exec "$DDP_HOSTS_ID" h2 python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.2", 29500)); s.listen(1); c, a = s.accept()
print("h2 got", c.recv(64).decode(), "from", a[0], flush=True)' &
listener=$!
sleep 0.5
"$TOOL" exec "$DDP_HOSTS_ID" h1 python3 -c '
import socket, time
for i in range(50):
    try:
        socket.create_connection(("10.77.0.2", 29500), timeout=2).sendall(b"hello"); break
    except OSError: time.sleep(0.1)'
wait $listener
R
chmod +x "$work/tcp.sh"
out=$("$run" --hosts 2 --hosts-only --timeout 30 "$work/tcp.sh" 2>&1)
rc=$?
[ $rc = 0 ] || fail "--hosts-only: exit $rc: $out"
grep -q "h2 got hello from 10.77.0.1" <<< "$out" || fail "no TCP from h1 to h2: $out"
ok "--hosts-only: TCP from h1 to h2 across the bridge"

# 3. A capped link: 4 MB from h1 to h2 at 100 Mbit/s takes at least 0.3 s (0.34 s at line rate).
cat > "$work/rate.sh" << 'R'
#!/usr/bin/env bash
"$TOOL" exec "$DDP_HOSTS_ID" h2 python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.77.0.2", 29501)); s.listen(1); c, a = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print("received %d" % n, flush=True); c.sendall(b"k")' &  # printed before h1 can print
sleep 0.5
"$TOOL" exec "$DDP_HOSTS_ID" h1 python3 -c '
import socket, time
for i in range(50):
    try:
        c = socket.create_connection(("10.77.0.2", 29501), timeout=5); break
    except OSError: time.sleep(0.1)
t = time.time(); c.sendall(bytes(4000000)); c.shutdown(socket.SHUT_WR); c.recv(1)
print("seconds %.3f" % (time.time() - t), flush=True)'
wait
R
chmod +x "$work/rate.sh"
out=$("$run" --hosts 2 --hosts-only --link-rate 100mbit --timeout 30 "$work/rate.sh" 2>&1)
rc=$?
secs=$(grep -o 'seconds [0-9.]*' <<< "$out" | cut -d' ' -f2)
[ $rc = 0 ] && grep -q "received 4000000" <<< "$out" || fail "capped link: exit $rc: $out"
awk -v s="${secs:-0}" 'BEGIN { exit !(s >= 0.3 && s < 5) }' || fail "4 MB at 100 Mbit/s took ${secs:-?} s (want 0.3-5 s): $out"
ok "a link capped at 100 Mbit/s: 4 MB in $secs s"

# 4. A host dies (every process on h2 killed): the job ends, not hangs; nothing left behind.
t0=$(ms)
out=$(MODE=kill-host HOSTS=2 "$run" --hosts 2 --ranks-per-host 1 --timeout 60 --mpiexec "$mpiexec" "$work/rank.sh" 2>&1)
rc=$?
dt=$(($(ms) - t0))
echo "$out" > "$work/4.log"
id=$(jobs_id "$work/4.log")
[ $rc != 0 ] || fail "a dead host: exit 0: $out"
[ $rc != 124 ] || fail "a dead host: the job ran into its time limit instead of ending: $out"
[ -z "$(leftovers "$id")" ] || fail "a dead host: cluster $id left behind: $(leftovers "$id")"
ok "host h2 killed: the job ended with $rc after $dt ms; nothing left"

# 5. --timeout with ranks that never end: exit 124, no namespace or process left.
out=$(MODE=sleep "$run" --hosts 2 --ranks-per-host 1 --timeout 3 --mpiexec "$mpiexec" "$work/rank.sh" 2>&1)
rc=$?
echo "$out" > "$work/5.log"
id=$(jobs_id "$work/5.log")
[ $rc = 124 ] || fail "timeout: exit $rc, expected 124: $out"
sleep 0.5
[ -z "$(leftovers "$id")" ] || fail "timeout: cluster $id left behind: $(leftovers "$id")"
pgrep -f "$work/rank.sh" > /dev/null && fail "timeout: a rank still runs"
ok "timeout: exit 124; nothing left"

# 6. The launcher killed: by SIGTERM it cleans up; by SIGKILL the next run's sweep does.
for sig in TERM KILL; do
  MODE=sleep "$run" --hosts 2 --ranks-per-host 1 --timeout 60 --mpiexec "$mpiexec" "$work/rank.sh" > "$work/6$sig.log" 2>&1 &
  launcher=$!
  for i in $(seq 100); do grep -q "DDP_HOSTS_ID" "$work/6$sig.log" && break; sleep 0.1; done
  id=$(jobs_id "$work/6$sig.log")
  kill -"$sig" "$launcher"
  wait "$launcher" 2> /dev/null
  if [ "$sig" = KILL ]; then
    [ -n "$(leftovers "$id")" ] || fail "SIGKILL: expected cluster $id still there before the sweep"
    "$tool" sweep  # its owner is gone: the hosts go, and what still ran on them
  fi
  sleep 0.5
  [ -n "$id" ] || fail "SIG$sig: the job never started: $(cat "$work/6$sig.log")"
  [ -z "$(leftovers "$id")" ] || fail "SIG$sig: cluster $id left behind: $(leftovers "$id")"
  pgrep -f "$work/rank.sh" > /dev/null && fail "SIG$sig: a rank still runs"
  ok "launcher killed by SIG$sig: nothing left$([ "$sig" = KILL ] && echo " after the sweep")"
done

# 8. A dropped link (`link ID h2 drop`): h2 neither answers nor reaches anyone (a connect times out
# where it was refused: no packet comes back), tc counts the drops on both ends, h1 still reaches
# itself; `link up` restores the link and its rate cap. A port nobody listens on tells the two
# apart without a server: refused means reached.
cat > "$work/drop.sh" << 'R'
#!/usr/bin/env bash
reach() {  # reach FROM ADDR: refused, or timeout
  "$TOOL" exec "$DDP_HOSTS_ID" "$1" timeout 2 bash -c "exec 3<> /dev/tcp/$2/29502" 2> /dev/null
  case $? in 124) echo timeout ;; 0) echo connected ;; *) echo refused ;; esac
}
drops() { "$TOOL" exec "$DDP_HOSTS_ID" h2 tc -s qdisc show dev eth0 | grep -o 'dropped [0-9]*' | cut -d' ' -f2; }
echo "before h1-h2 $(reach h1 10.77.0.2)"
"$TOOL" link "$DDP_HOSTS_ID" h2 drop || exit 1
at=$(dirname "$0")  # the probes that time out, at once
reach h1 10.77.0.2 > "$at/12" &
reach h2 10.77.0.1 > "$at/21" &
reach h1 10.77.0.1 > "$at/11" &
wait
echo "dropped h1-h2 $(cat "$at/12") h2-h1 $(cat "$at/21") h1-h1 $(cat "$at/11")"
echo "drops eth0 $(drops) veth $(tc -s qdisc show dev "${DDP_HOSTS_ID}h2" | grep -o 'dropped [0-9]*' | cut -d' ' -f2)"
"$TOOL" link "$DDP_HOSTS_ID" h2 up || exit 1
echo "restored h1-h2 $(reach h1 10.77.0.2) h2-h1 $(reach h2 10.77.0.1)"
echo "cap $("$TOOL" exec "$DDP_HOSTS_ID" h2 tc qdisc show dev eth0 | grep -o 'rate [0-9]*Mbit') / $(tc qdisc show dev "${DDP_HOSTS_ID}h2" | grep -o 'rate [0-9]*Mbit')"
R
chmod +x "$work/drop.sh"
out=$("$run" --hosts 2 --hosts-only --link-rate 100mbit --timeout 60 "$work/drop.sh" 2>&1)
rc=$?
[ $rc = 0 ] || fail "a dropped link: exit $rc: $out"
grep -q "before h1-h2 refused" <<< "$out" || fail "h1 did not reach h2 before the drop: $out"
grep -q "dropped h1-h2 timeout h2-h1 timeout h1-h1 refused" <<< "$out" || fail "a dropped link let packets through: $out"
grep -Eq "drops eth0 [1-9][0-9]* veth [1-9]" <<< "$out" || fail "tc counted no drops on both ends: $out"
grep -q "restored h1-h2 refused h2-h1 refused" <<< "$out" || fail "the link did not come back: $out"
grep -q "cap rate 100Mbit / rate 100Mbit" <<< "$out" || fail "the rate cap did not come back: $out"
ok "a dropped link: no packet either way, drops counted; up again with its 100 Mbit/s cap"

# 7. Bad input: a clear error, no cluster.
out=$("$run" --hosts 2 --ranks-per-host 1 -n 3 "$work/rank.sh" 2>&1)
rc=$?
[ $rc = 2 ] && grep -q "do not fit" <<< "$out" || fail "3 ranks on 2 x 1: exit $rc: $out"
out=$("$run" --hosts 2 --link-rate fast "$work/rank.sh" 2>&1)
rc=$?
[ $rc = 2 ] && grep -q "not a tc rate" <<< "$out" || fail "--link-rate fast: exit $rc: $out"
ok "bad input: clear errors"

echo "$passed passed, $failures failed"
[ $failures = 0 ]
