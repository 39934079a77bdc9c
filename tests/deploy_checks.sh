#!/usr/bin/env bash
# Checks of what deploy/ ships: the systemd unit, the Prometheus configuration and rules,
# and the Debian package. Registered with CTest (label `deploy`) by tests/deploy.cmake,
# one test per subcommand:
#
#   deploy_checks.sh unit-verify     SRC KVTIERD   systemd-analyze verify, ExecStart -> KVTIERD
#   deploy_checks.sh unit-security   SRC           systemd-analyze security: exposure <= 2.0
#   deploy_checks.sh prometheus      SRC           promtool check config/rules, test rules
#   deploy_checks.sh metric-names    SRC KVTIERD   every kvtier_* name in the rules is exported
#   deploy_checks.sh unit-shm        SRC KVTIERD KVTIER
#                                                  the unit's sandbox admits the shared-memory
#                                                  data plane (address families, namespaces,
#                                                  every system call of a traced session)
#   deploy_checks.sh deb             SRC BUILD     cpack, dpkg -i, run, dpkg -r, dpkg -P
#
# Exit status 77 means skipped (a tool is missing, or the deb test is not root).
set -euo pipefail

SKIP=77
log() { printf '%s\n' "$*" >&2; }
skip() { log "SKIP: $*"; exit "$SKIP"; }
fail() { log "FAIL: $*"; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || skip "$1 is not installed (scripts/deps.sh installs it)"; }

# Largest exposure `systemd-analyze security` may give the unit (0 best, 10 worst).
MAX_EXPOSURE=2.0

cmd="${1:?usage: deploy_checks.sh COMMAND SRC [ARG]}"
SRC="${2:?source directory}"
UNIT="$SRC/deploy/kvtierd.service"

# A scratch directory (made below) removed on exit, and a daemon killed on exit; the deb
# test adds its purge.
WORK=""
DAEMON_PID=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then kill -KILL "$DAEMON_PID"; fi
  deb_purge_if_ours
  [ -z "$WORK" ] || rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

# HTTP GET over bash's /dev/tcp (no curl needed); prints the whole response.
http_get() {  # PORT PATH
  exec 3<>"/dev/tcp/127.0.0.1/$1"
  printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$2" >&3
  cat <&3
  exec 3<&-
}

# Waits for a port file (line 1 gRPC port, line 2 metrics port) while PID lives.
wait_port_file() {  # FILE PID LOG
  local _
  for _ in $(seq 1 300); do
    if [ -s "$1" ] && [ "$(sed -n 1p "$1")" -gt 0 ] 2>/dev/null; then return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then
      log "kvtierd exited before writing its port file; its output:"; cat "$3" >&2
      return 1
    fi
    sleep 0.1
  done
  log "kvtierd wrote no port file within 30 s; its output:"; cat "$3" >&2
  return 1
}

# SIGTERM, then the exit status must be 0 (graceful shutdown) within 60 s.
stop_daemon() {  # PID LOG
  kill -TERM "$1"
  local rc
  for _ in $(seq 1 600); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -KILL "$1"; cat "$2" >&2; fail "kvtierd did not exit within 60 s of SIGTERM"
  fi
  rc=0; wait "$1" || rc=$?
  [ "$rc" -eq 0 ] || { cat "$2" >&2; fail "kvtierd exited with status $rc after SIGTERM"; }
}

unit_verify() {
  local kvtierd="${3:?kvtierd path}" dir out rc=0
  need systemd-analyze
  [ -x "$kvtierd" ] || fail "$kvtierd is not built"
  dir=$WORK
  # verify checks that ExecStart's binary exists, so point it at the built one.
  sed "s|^ExecStart=/usr/bin/kvtierd |ExecStart=$kvtierd |" "$UNIT" >"$dir/kvtierd.service"
  grep -q "^ExecStart=$kvtierd --config /etc/kvtier/kvtierd.toml\$" "$dir/kvtierd.service" ||
    fail "unit has no 'ExecStart=/usr/bin/kvtierd --config /etc/kvtier/kvtierd.toml' line"
  out=$(systemd-analyze verify "$dir/kvtierd.service" 2>&1) || rc=$?
  printf '%s\n' "$out"
  [ "$rc" -eq 0 ] || fail "systemd-analyze verify exited with $rc"
  # Warnings about this unit (unknown or misspelled settings) still exit 0.
  if printf '%s\n' "$out" | grep -q kvtierd; then fail "systemd-analyze verify warned"; fi
  # The unit and the packaged config must agree on the data directory.
  grep -qx 'Type=notify' "$UNIT" || fail "unit is not Type=notify"
  grep -qx 'StateDirectory=kvtier' "$UNIT" || fail "unit has no StateDirectory=kvtier"
  # The config's listen_unix example, /run/kvtier/kvtierd.sock, under ProtectSystem=strict.
  grep -qx 'RuntimeDirectory=kvtier' "$UNIT" || fail "unit has no RuntimeDirectory=kvtier"
  grep -qx 'User=kvtier' "$UNIT" || fail "unit does not run as kvtier"
  log "OK: systemd-analyze verify"
}

unit_security() {
  need systemd-analyze
  score_unit "$UNIT" "the packaged unit"
  # The same unit with the GPU drop-in (deploy/kvtierd-gpu.conf) applied: its settings
  # appended to [Service], where later assignments win as in a drop-in.
  local dir
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' RETURN
  awk -v dropin="$SRC/deploy/kvtierd-gpu.conf" '
    /^\[Install\]/ { while ((getline line < dropin) > 0) if (line !~ /^(#|\[Service\])/) print line }
    { print }' "$UNIT" >"$dir/kvtierd.service"
  grep -q '^PrivateDevices=no$' "$dir/kvtierd.service" || fail "GPU drop-in was not applied"
  score_unit "$dir/kvtierd.service" "the unit with the GPU drop-in"
}

score_unit() {
  local unit=$1 what=$2 out score
  out=$(systemd-analyze security --offline=true --no-pager "$unit" 2>&1) ||
    { printf '%s\n' "$out"; fail "systemd-analyze security failed ($what)"; }
  printf '%s\n' "$out" | grep -v '^✓' || true
  score=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for kvtierd.service: \([0-9.]*\).*/\1/p')
  [ -n "$score" ] || fail "no exposure level in systemd-analyze security's output ($what)"
  awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s + 0 <= m + 0) }' ||
    fail "exposure $score of $what is above $MAX_EXPOSURE"
  log "OK: exposure $score <= $MAX_EXPOSURE ($what)"
}

prometheus_checks() {
  local dir="$SRC/deploy/prometheus"
  need promtool
  # check config resolves rule_files relative to the config file and checks them too.
  promtool check config "$dir/prometheus.yml"
  promtool check rules "$dir/kvtier-alerts.yml"
  # test rules resolves rule_files relative to the test file.
  promtool test rules "$dir/kvtier-alerts.test.yml"
  grep -q 'targets: \["127.0.0.1:9464"\]' "$dir/prometheus.yml" ||
    fail "prometheus.yml does not scrape 127.0.0.1:9464"
  log "OK: promtool"
}

# Starts the built kvtierd and checks that every kvtier_* metric the rules name is
# exported, so that a renamed metric cannot silently disable an alert.
metric_names() {
  local kvtierd="${3:?kvtierd path}" dir pid names name missing=() metrics_port
  [ -x "$kvtierd" ] || fail "$kvtierd is not built"
  # Not `--help | grep -q`: grep stops at the first match, kvtierd dies of SIGPIPE
  # writing the rest, and pipefail then reads the flag as missing (this check skipped
  # itself that way on every run).
  grep -q -- '--metrics-listen' <<<"$("$kvtierd" --help 2>&1)" ||
    skip "this kvtierd has no --metrics-listen"
  dir=$WORK
  "$kvtierd" --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --data-dir="$dir/data" \
    --ram-capacity=64MiB --ssd-capacity=256MiB --port-file="$dir/port" >"$dir/log" 2>&1 &
  pid=$!; DAEMON_PID=$pid
  wait_port_file "$dir/port" "$pid" "$dir/log" || fail "kvtierd did not start"
  metrics_port=$(sed -n 2p "$dir/port")
  [ "${metrics_port:-0}" -gt 0 ] 2>/dev/null || fail "no metrics port in the port file"
  http_get "$metrics_port" /metrics >"$dir/metrics"
  head -1 "$dir/metrics" | grep -q ' 200' || { cat "$dir/metrics" >&2; fail "GET /metrics"; }
  grep -q '^kvtier_up 1' "$dir/metrics" || fail "no 'kvtier_up 1' in /metrics"
  names=$(grep -o 'kvtier_[a-z_]*[a-z]' "$SRC/deploy/prometheus/kvtier-alerts.yml" | sort -u)
  for name in $names; do
    grep -Eq "^$name(\{| )" "$dir/metrics" || missing+=("$name")
  done
  stop_daemon "$pid" "$dir/log"; DAEMON_PID=""
  [ ${#missing[@]} -eq 0 ] || fail "kvtier-alerts.yml uses metrics kvtierd does not export: ${missing[*]}"
  log "OK: all $(echo "$names" | wc -w) kvtier_* names in kvtier-alerts.yml are exported"
}

# --- deb ----------------------------------------------------------------------------
# Builds the package, installs it on this machine, runs the installed daemon as `kvtier`
# from the installed config, then removes and purges it. Purges on any exit (trap). A
# kvtier package that this test did not install is left alone: the test skips.
# The shared-memory data plane under the unit's sandbox. What systemd would apply cannot
# be applied here without systemd as PID 1, so each setting that could stop it is checked
# against what the daemon actually does: a kvtierd with the packaged shm settings runs
# under strace while the CLI puts and gets a chunk through shared memory, and every system
# call it made must pass the unit's SystemCallFilter (tests/unit_syscalls.py expands it
# with systemd-analyze). The rest is read from the unit: AF_UNIX must be allowed (the
# region socket), the network namespace shared (the default socket is abstract, and
# abstract names live in the network namespace), and memfds are not IPC objects that
# RemoveIPC= would remove.
unit_shm() {
  local kvtierd="${3:?kvtierd path}" cli="${4:?kvtier CLI path}" dir spid pid port ns key out
  need strace; need systemd-analyze
  [ -x "$kvtierd" ] || fail "$kvtierd is not built"
  [ -x "$cli" ] || fail "$cli is not built"
  strace -f -qq -o /dev/null true 2>/dev/null || skip "strace cannot trace here (ptrace denied)"
  grep -Eq '^RestrictAddressFamilies=.*\bAF_UNIX\b' "$UNIT" ||
    fail "RestrictAddressFamilies= does not allow AF_UNIX: the region socket cannot be created"
  if grep -Eq '^PrivateNetwork=(yes|true|on|1)' "$UNIT"; then
    fail "PrivateNetwork=yes hides the abstract region socket from clients"
  fi
  grep -qx 'shm_socket = "auto"' "$SRC/deploy/kvtierd.toml" ||
    fail "deploy/kvtierd.toml does not ship shm_socket = \"auto\" (abstract, unaffected by PrivateTmp)"
  dir=$WORK
  # The packaged configuration's shm settings, on a small pool in a scratch directory.
  strace -f -qq -o "$dir/trace" "$kvtierd" --config "$SRC/deploy/kvtierd.toml" \
    --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --data-dir="$dir/data" \
    --ram-capacity=64MiB --ssd-capacity=256MiB --port-file="$dir/port" >"$dir/log" 2>&1 &
  spid=$!; DAEMON_PID=$spid
  wait_port_file "$dir/port" "$spid" "$dir/log" || fail "kvtierd did not start under strace"
  pid=$(cat /proc/"$spid"/task/*/children | tr ' ' '\n' | grep -m1 .) ||
    fail "no kvtierd child of strace"
  port=$(sed -n 1p "$dir/port")
  ns=$("$cli" --target "127.0.0.1:$port" register --model-id unit-shm --dtype fp16 --layers 2 \
         --kv-heads 2 --head-dim 64 --tokens-per-chunk 16 | awk '/^namespace_id/ {print $2}')
  [ -n "$ns" ] || fail "register failed"
  key=00112233445566778899aabbccddeeff
  head -c 16384 /dev/urandom >"$dir/in"
  out=$("$cli" --target "127.0.0.1:$port" put --namespace "$ns" "$key=$dir/in" 2>&1) ||
    { printf '%s\n' "$out" >&2; fail "put"; }
  printf '%s\n' "$out" | grep -q 'data path: shared memory' ||
    { printf '%s\n' "$out" >&2; fail "put did not go through shared memory"; }
  out=$("$cli" --target "127.0.0.1:$port" get --namespace "$ns" "$key=$dir/out" 2>&1) ||
    { printf '%s\n' "$out" >&2; fail "get"; }
  printf '%s\n' "$out" | grep -q 'data path: shared memory' ||
    { printf '%s\n' "$out" >&2; fail "get did not go through shared memory"; }
  cmp "$dir/in" "$dir/out" || fail "the chunk read back differs from the one put"
  # SIGTERM the daemon (strace passes it on and exits with the daemon's status).
  kill -TERM "$pid"
  local rc=0; wait "$spid" || rc=$?
  DAEMON_PID=""
  [ "$rc" -eq 0 ] || { cat "$dir/log" >&2; fail "kvtierd exited with status $rc under strace"; }
  /usr/bin/python3 "$SRC/tests/unit_syscalls.py" "$UNIT" "$dir/trace" ||
    fail "the unit's SystemCallFilter would deny system calls the daemon made (above)"
  # A path region socket handed to shm_allowed_group (the setup kvtierd.toml describes
  # for a socket in the unit's RuntimeDirectory): its start-up chowns the socket.
  strace -f -qq -o "$dir/trace-path" "$kvtierd" --config "$SRC/deploy/kvtierd.toml" \
    --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 --data-dir="$dir/data-path" \
    --ram-capacity=64MiB --ssd-capacity=256MiB --port-file="$dir/port-path" \
    --shm-socket="$dir/region.sock" --shm-allowed-group="$(id -g)" >"$dir/log-path" 2>&1 &
  spid=$!; DAEMON_PID=$spid
  wait_port_file "$dir/port-path" "$spid" "$dir/log-path" ||
    fail "kvtierd did not start under strace with a path shm_socket"
  pid=$(cat /proc/"$spid"/task/*/children | tr ' ' '\n' | grep -m1 .) ||
    fail "no kvtierd child of strace"
  kill -TERM "$pid"
  rc=0; wait "$spid" || rc=$?
  DAEMON_PID=""
  [ "$rc" -eq 0 ] || { cat "$dir/log-path" >&2; fail "kvtierd exited with status $rc under strace"; }
  grep -Eq '^[0-9]+ +(chown|fchownat|lchown)\(' "$dir/trace-path" ||
    fail "the traced daemon did not chown its path region socket"
  /usr/bin/python3 "$SRC/tests/unit_syscalls.py" "$UNIT" "$dir/trace-path" ||
    fail "the unit's SystemCallFilter would deny system calls of a path shm_socket (above)"
  log "OK: the shared-memory data plane works within the unit's sandbox settings"
}

MARKER=/var/tmp/kvtier-deploy-test.installed
DEB_OWNS_MARKER=""

deb_purge_if_ours() {
  [ -n "$DEB_OWNS_MARKER" ] || return 0
  if [ -n "$(deb_status)" ]; then
    log "cleanup: purging kvtier"
    DEBIAN_FRONTEND=noninteractive dpkg -P kvtier </dev/null >&2
  fi
  # A run that failed between its `systemctl enable` and the purge's check.
  rm -f /etc/systemd/system/multi-user.target.wants/kvtierd.service
  rm -f "$MARKER"
}

deb_status() { dpkg-query -W -f='${db:Status-Abbrev}' kvtier 2>/dev/null | tr -d ' ' || true; }

deb_test() {
  local build="${3:?build directory}" deb f port pid_user extra=() DEB_WORK DEB_PID
  [ "$(id -u)" -eq 0 ] || skip "needs root (installs the package)"
  need dpkg; need dpkg-deb; need cpack; need setpriv
  [ -f "$build/CPackConfig.cmake" ] || fail "$build/CPackConfig.cmake is missing"
  need flock
  # One deb test at a time per machine (several build trees may run their tests at
  # once). The lock dies with this process, so a marker found while holding it is a
  # killed run's leftover, never a running test's package.
  exec 9>"$MARKER.lock"
  flock -w 600 9 || fail "another deb test held $MARKER.lock for 10 minutes"
  if [ -n "$(deb_status)" ] && [ ! -e "$MARKER" ]; then
    skip "a kvtier package this test did not install is on this machine ($(deb_status)); not touching it"
  fi
  DEB_OWNS_MARKER=1
  touch "$MARKER"
  # A run killed before its cleanup left the package behind: start from scratch.
  if [ -n "$(deb_status)" ]; then DEBIAN_FRONTEND=noninteractive dpkg -P kvtier </dev/null; fi
  DEB_WORK=$WORK

  # 1. Build. cpack first brings the build up to date (its preinstall step).
  (cd "$build" && cpack -G DEB -B "$DEB_WORK/pkg" --config "$build/CPackConfig.cmake") ||
    fail "cpack -G DEB failed"
  deb=$(ls "$DEB_WORK"/pkg/kvtier_*.deb)
  [ "$(echo "$deb" | wc -l)" -eq 1 ] || fail "expected one .deb, got: $deb"
  dpkg-deb --info "$deb"
  dpkg-deb --contents "$deb"
  for f in ./usr/bin/kvtierd ./usr/bin/kvtier ./lib/systemd/system/kvtierd.service \
           ./etc/kvtier/kvtierd.toml ./usr/share/kvtier/kvtierd.toml \
           ./usr/lib/python3/dist-packages/kvtier/__init__.py \
           ./usr/lib/python3/dist-packages/kvtier/v1/kvtier_pb2.py; do
    dpkg-deb --contents "$deb" | awk '{print $6}' | grep -qx "$f" || fail "package lacks $f"
  done
  dpkg-deb --field "$deb" Depends | grep -q 'libc6' ||
    fail "Depends has no libc6: dpkg-shlibdeps did not run"
  dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/kvtier/kvtierd.toml ||
    fail "/etc/kvtier/kvtierd.toml is not a conffile"

  # 1b. An install whose binaries would not be where the unit runs them is refused.
  if DESTDIR="$DEB_WORK/local" cmake --install "$build" --prefix /usr/local \
       >"$DEB_WORK/local.log" 2>&1; then
    fail "cmake --install --prefix /usr/local installed a unit that runs /usr/bin/kvtierd"
  fi
  grep -q -- "--prefix /usr" "$DEB_WORK/local.log" || fail "the refusal does not say what to do"
  [ ! -e "$DEB_WORK/local/lib/systemd/system/kvtierd.service" ] ||
    fail "a unit was installed for binaries under /usr/local"

  # 2. Install.
  DEBIAN_FRONTEND=noninteractive dpkg -i "$deb" </dev/null
  [ "$(deb_status)" = ii ] || fail "kvtier is not installed after dpkg -i: $(deb_status)"
  for f in /usr/bin/kvtierd /usr/bin/kvtier; do [ -x "$f" ] || fail "$f missing"; done
  cmp "$UNIT" /lib/systemd/system/kvtierd.service || fail "installed unit differs"
  grep -qx 'data_dir = "/var/lib/kvtier"' /etc/kvtier/kvtierd.toml ||
    fail "/etc/kvtier/kvtierd.toml does not set data_dir = \"/var/lib/kvtier\""
  getent passwd kvtier >/dev/null || fail "user kvtier was not created"
  getent group kvtier >/dev/null || fail "group kvtier was not created"
  [ "$(stat -c %U:%G /var/lib/kvtier)" = kvtier:kvtier ] || fail "/var/lib/kvtier is not kvtier's"
  /usr/bin/kvtierd --version
  /usr/bin/kvtier --help >/dev/null

  # 3. Run the installed daemon from the installed config, as kvtier, as the unit would
  # (no systemd here). Only the ports are overridden, to free ones.
  mkdir "$DEB_WORK/run"; chown kvtier:kvtier "$DEB_WORK/run"; chmod 755 "$DEB_WORK"
  if grep -q -- '--metrics-listen' <<<"$(/usr/bin/kvtierd --help 2>&1)"; then
    extra=(--metrics-listen=127.0.0.1:0)
  fi
  (cd /var/lib/kvtier && exec setpriv --reuid=kvtier --regid=kvtier --init-groups \
     /usr/bin/kvtierd --config /etc/kvtier/kvtierd.toml --listen=127.0.0.1:0 \
     "${extra[@]}" --port-file="$DEB_WORK/run/port") >"$DEB_WORK/daemon.log" 2>&1 &
  DEB_PID=$!; DAEMON_PID=$DEB_PID
  wait_port_file "$DEB_WORK/run/port" "$DEB_PID" "$DEB_WORK/daemon.log" ||
    fail "installed kvtierd did not start"
  pid_user=$(stat -c %U "/proc/$DEB_PID")
  [ "$pid_user" = kvtier ] || fail "kvtierd runs as '$pid_user', not kvtier"
  port=$(sed -n 1p "$DEB_WORK/run/port")
  /usr/bin/kvtier --target "127.0.0.1:$port" stats || fail "kvtier stats against the installed daemon"
  # The Python package the .deb ships, imported by Debian's python3 from its own path
  # (no PYTHONPATH), talking to the installed daemon.
  (cd / && env -u PYTHONPATH /usr/bin/python3 -c \
     'import sys, kvtier; assert kvtier.__file__.startswith("/usr/lib/python3/dist-packages/"); print(kvtier.Client(sys.argv[1], connect_timeout=10).stats().write_mode)' \
     "127.0.0.1:$port") || fail "the installed Python package cannot reach the installed daemon"
  if [ ${#extra[@]} -gt 0 ]; then
    http_get "$(sed -n 2p "$DEB_WORK/run/port")" /healthz | head -1 | grep -q ' 200' ||
      fail "GET /healthz did not answer 200"
  fi
  [ -d /var/lib/kvtier/ssd ] || fail "kvtierd did not create /var/lib/kvtier/ssd"
  [ "$(stat -c %U /var/lib/kvtier/ssd)" = kvtier ] || fail "/var/lib/kvtier/ssd is not kvtier's"
  stop_daemon "$DEB_PID" "$DEB_WORK/daemon.log"; DAEMON_PID=""
  cat "$DEB_WORK/daemon.log"

  # 4. Upgrade in place (the same version again): an edited conffile is kept, silently.
  echo '# local edit' >>/etc/kvtier/kvtierd.toml
  DEBIAN_FRONTEND=noninteractive dpkg -i "$deb" </dev/null
  grep -qx '# local edit' /etc/kvtier/kvtierd.toml || fail "reinstall lost the conffile edit"

  # 5. Remove: binaries and unit go; config, data, user and enablement stay. The
  # operator enabled the service (systemctl works on the files without a running systemd).
  wants=/etc/systemd/system/multi-user.target.wants/kvtierd.service
  systemctl enable kvtierd.service
  [ -L "$wants" ] || fail "systemctl enable made no $wants link"
  DEBIAN_FRONTEND=noninteractive dpkg -i "$deb" </dev/null  # Records the enablement.
  DEBIAN_FRONTEND=noninteractive dpkg -r kvtier </dev/null
  [ "$(deb_status)" = rc ] || fail "after dpkg -r the status is '$(deb_status)', not rc"
  for f in /usr/bin/kvtierd /usr/bin/kvtier /lib/systemd/system/kvtierd.service; do
    [ ! -e "$f" ] || fail "$f is still there after dpkg -r"
  done
  [ -f /etc/kvtier/kvtierd.toml ] || fail "dpkg -r removed the conffile"
  [ -d /var/lib/kvtier/ssd ] || fail "dpkg -r removed the data"
  getent passwd kvtier >/dev/null || fail "dpkg -r removed the user"

  # 6. Purge: everything goes.
  DEBIAN_FRONTEND=noninteractive dpkg -P kvtier </dev/null
  [ -z "$(deb_status)" ] || [ "$(deb_status)" = un ] || [ "$(deb_status)" = pn ] ||
    fail "after dpkg -P the status is '$(deb_status)'"
  for f in /etc/kvtier /var/lib/kvtier /usr/share/kvtier; do
    [ ! -e "$f" ] || fail "$f is still there after dpkg -P"
  done
  # Disabled: a later install would otherwise start at the next boot.
  [ ! -L "$wants" ] || fail "dpkg -P left $wants (the service stays enabled)"
  [ ! -L /etc/systemd/system/kvtierd.service ] || fail "dpkg -P left kvtierd masked"
  ! getent passwd kvtier >/dev/null || fail "dpkg -P left user kvtier"
  ! getent group kvtier >/dev/null || fail "dpkg -P left group kvtier"
  log "OK: package built, installed, served, upgraded, removed and purged"
}

WORK=$(mktemp -d)
case "$cmd" in
  unit-verify) unit_verify "$@" ;;
  unit-security) unit_security "$@" ;;
  prometheus) prometheus_checks "$@" ;;
  metric-names) metric_names "$@" ;;
  unit-shm) unit_shm "$@" ;;
  deb) deb_test "$@" ;;
  *) fail "unknown command $cmd" ;;
esac
