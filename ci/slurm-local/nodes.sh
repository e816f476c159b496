# Namespace nodes of the local Slurm cluster (sourced by up.sh and down.sh; not run alone).
#
# Node i (1..N) is a network namespace `slurm-local-node<i>` with its own loopback, a veth
# `eth0` at $SUBNET.(10+i)/24 on the host bridge `slurm-local0` ($SUBNET.1, where slurmctld
# answers), and one slurmd, started in UTS and mount namespaces of its own: host name
# `node<i>`, /etc/hosts bind-mounted from /etc/netns/<ns>/hosts (every node's name and
# address). Everything else (files, munge's socket, /sys/fs/cgroup, /tmp) is shared, as on a
# cluster with a shared file system. (`ip netns exec` would mount a fresh /sys without
# cgroups, where slurmd does not start: hence nsenter + unshare.) $SUBNET is in 198.18.0.0/15, the range reserved for
# network test beds (RFC 2544): nothing outside this machine answers there.
#
# Needs: BASE RUN LOG SUBNET, and the helpers alive/log from the sourcing script.

BRIDGE=slurm-local0

# stop_pidfile PIDFILE NAME: SIGTERM the daemon named in PIDFILE, SIGKILL after 15 s
stop_pidfile() {
  alive "$1" "$2" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null
  for _ in $(seq 75); do alive "$1" "$2" || break; sleep 0.2; done
  if alive "$1" "$2"; then log "$2 ($pid) ignored SIGTERM: killing"; kill -9 "$pid" 2>/dev/null; fi
  rm -f "$1"; log "stopped $2 ($pid)"
}
ns_name() { echo "slurm-local-node$1"; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }

# hosts_file N: /etc/hosts of every node (and of the host's address on the bridge)
hosts_file() {
  local i
  echo "127.0.0.1 localhost"
  echo "$SUBNET.1 $(hostname -s)-bridge"
  for i in $(seq "$1"); do echo "$(node_addr "$i") node$i"; done
}

# kill_ns_pids NS: end the processes still inside namespace NS (a job's orphans after its
# slurmd was stopped), each by its pid: SIGTERM, then SIGKILL after 5 s
kill_ns_pids() {
  local pids; pids=$(ip netns pids "$1" 2>/dev/null) || return 0
  [ -n "$pids" ] || return 0
  log "ending processes left in $1: ${pids//$'\n'/ }"
  # shellcheck disable=SC2086
  kill $pids 2>/dev/null
  for _ in $(seq 25); do [ -z "$(ip netns pids "$1" 2>/dev/null)" ] && return 0; sleep 0.2; done
  pids=$(ip netns pids "$1" 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  sleep 0.2
}

# remove_node I: namespace, veth (its host end goes with it), hosts file; its slurmd must be stopped
remove_node() {
  local ns; ns=$(ns_name "$1")
  if [ -e "/run/netns/$ns" ]; then
    kill_ns_pids "$ns"
    ip netns del "$ns" && log "removed namespace $ns"
  fi
  ip link del "sl-node$1" 2>/dev/null
  rm -rf "/etc/netns/$ns"
}

# add_node I N: a fresh namespace for node I of N, wired to the bridge
add_node() {
  local ns; ns=$(ns_name "$1")
  ip netns add "$ns" || return 1
  ip link add "sl-node$1" type veth peer name eth0 netns "$ns" || return 1
  ip link set "sl-node$1" master "$BRIDGE" up || return 1
  ip -n "$ns" addr add "$(node_addr "$1")/24" dev eth0 || return 1
  ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up || return 1
  [ -d /etc/netns ] || { mkdir /etc/netns && touch "$RUN/created-etc-netns"; }
  mkdir -p "/etc/netns/$ns" && hosts_file "$2" > "/etc/netns/$ns/hosts"
}

# bridge_up: the host's end of the nodes' network. It must exist while slurmctld knows the
# nodes: without it the nodes' addresses would route to the default gateway, off this machine.
bridge_up() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || return 1
  fi
  ip addr replace "$SUBNET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up
}

# node_wired I: node I's namespace exists with its address (and its hosts file)
node_wired() {
  local ns; ns=$(ns_name "$1")
  [ -e "/run/netns/$ns" ] && [ -f "/etc/netns/$ns/hosts" ] &&
    ip -n "$ns" -4 addr show dev eth0 2>/dev/null | grep -q "inet $(node_addr "$1")/"
}

# nodes_up N: each node's namespace and slurmd; bridge_up first. A running slurmd is kept; a
# stopped one is started again in its namespace, where its jobs' processes may still run (as
# when an admin restarts slurmd: it finds their steps and slurmctld tells it what to end); a
# namespace that is not whole (a dirty host) is rebuilt, ending what was left in it.
nodes_up() {
  local n=$1 i ns
  for i in $(seq "$n"); do
    ns=$(ns_name "$i")
    if node_wired "$i"; then
      hosts_file "$n" > "/etc/netns/$ns/hosts"
      alive "$RUN/slurmd.node$i.pid" slurmd && continue
    else
      stop_pidfile "$RUN/slurmd.node$i.pid" slurmd
      remove_node "$i"   # whatever a dirty host left of it
      add_node "$i" "$n" || { echo "slurm-local: ERROR: could not create namespace $ns" >&2; return 1; }
    fi
    mkdir -p "$BASE/spool/node$i"
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave sh -c \
      "mount --bind /etc/netns/$ns/hosts /etc/hosts && hostname node$i && exec slurmd -N node$i" ||
      { echo "slurm-local: ERROR: slurmd of node$i failed, see $LOG/slurmd.node$i.log" >&2; return 1; }
    log "node$i up: namespace $ns, $(node_addr "$i"), slurmd $(cat "$RUN/slurmd.node$i.pid" 2>/dev/null)"
  done
  echo "$n" > "$RUN/nodes"
}

# nodes_down: every namespace node that a run of up.sh created (by name), then the bridge;
# slurmctld must be stopped first (see bridge_up)
nodes_down() {
  local f i
  for f in "$RUN"/slurmd.node*.pid; do [ -e "$f" ] && stop_pidfile "$f" slurmd; done
  for f in /run/netns/slurm-local-node*; do
    [ -e "$f" ] || continue
    i=${f##*/slurm-local-node}
    remove_node "$i"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" && log "removed bridge $BRIDGE"; fi
  rm -f "$RUN/nodes"
  if [ -e "$RUN/created-etc-netns" ]; then rmdir /etc/netns 2>/dev/null; rm -f "$RUN/created-etc-netns"; fi
  return 0
}
