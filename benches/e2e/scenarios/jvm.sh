# Scenario "jvm": wrk closed loop in front of a thread-per-connection JVM upstream (benches/e2e/jvm/JvmUpstream.java),
# the kind of server whose threads and memory follow its connections. Direct, every client is a thread in the JVM;
# behind a proxy with a cap of N, N threads should do. Sourced by run.sh.
#
# Settings (environment variables, e.g. `jvm_clients="200 1000" benches/e2e/run.sh -x jvm`):
#   jvm_clients    wrk connections, one run per value                       [200 1000 8000]
#   jvm_subjects   subjects                                                 [those of -S: all seven]
#   jvm_delay      service time, ms                                         [50]
#   jvm_heap       -Xms = -Xmx, so the RSS is the heap plus what threads and connections cost  [256m]
#   jvm_xss        thread stack size (-Xss)                                 [256k]
#   jvm_max_conns  connections the JVM accepts at once (each is a thread); more are closed at once  [9000]

: "${jvm_clients:=200 1000 8000}"
: "${jvm_subjects:=$subjects}"
: "${jvm_delay:=50}"
: "${jvm_heap:=256m}"
: "${jvm_xss:=256k}"
: "${jvm_max_conns:=9000}"

tools_jvm() { want_tool javac openjdk-17-jdk-headless; }

build_jvm() {
  javaclasses=$target_dir/e2e-jvm-upstream # not jvm_*: run.sh records every jvm_* variable as a setting
  if ((build)) || [[ ! -f $javaclasses/JvmUpstream.class ]]; then
    log "compiling the JVM upstream into $javaclasses"
    mkdir -p "$javaclasses"
    javac -d "$javaclasses" "$here/jvm/JvmUpstream.java" || die "javac failed"
  fi
}

# lib.sh's start_upstream calls this for upstream_kind=jvm and takes `$!` right after it: the java process itself
# (taskset, when pinned, execs it).
start_jvm_upstream() { # DELAY_MS DIR
  # -Xms = -Xmx and AlwaysPreTouch: the whole heap is resident from the start, so RSS does not depend on how much
  # of the heap the collector happened to touch at a given throughput; what changes between runs is threads and
  # connections. -Xss lowers only the stacks' reservation (address space), not what a thread touches: RSS per thread
  # is the same at 256k as at the default 1m for a server this shallow.
  "${pin_serve[@]}" java "-Xms$jvm_heap" "-Xmx$jvm_heap" "-Xss$jvm_xss" -XX:+AlwaysPreTouch \
    -cp "$javaclasses" JvmUpstream --delay-ms "$1" --max-conns "$jvm_max_conns" \
    >"$2/upstream.out" 2>"$2/upstream.err" &
}

# A direct run makes one JVM thread per client: make sure the machine has room for jvm_max_conns more threads (and
# their memory) before starting, rather than find out when fork fails everywhere.
jvm_check_room() {
  local want=$((jvm_max_conns + 1000)) pid_max threads_max nproc_limit used free mem_kb need_kb c
  for c in $jvm_clients; do
    ((c <= jvm_max_conns)) || log "jvm: $c clients but jvm_max_conns=$jvm_max_conns: direct runs refuse the rest"
  done
  pid_max=$(cat /proc/sys/kernel/pid_max) threads_max=$(cat /proc/sys/kernel/threads-max)
  nproc_limit=$(ulimit -u); [[ $nproc_limit == unlimited ]] && nproc_limit=$threads_max
  used=$(cut -d' ' -f4 /proc/loadavg); used=${used#*/} # every thread on the machine now
  free=$pid_max
  ((threads_max < free)) && free=$threads_max
  ((nproc_limit < free)) && free=$nproc_limit
  free=$((free - used))
  ((free >= want)) || die "jvm: room for $free more threads (pid_max $pid_max, threads-max $threads_max, ulimit -u" \
    "$nproc_limit, $used in use); jvm_max_conns=$jvm_max_conns needs about $want"
  # Measured: about 110 kB resident per connection thread; 512 kB leaves room for surprises.
  mem_kb=$(awk '/^MemAvailable/ { print $2 }' /proc/meminfo)
  need_kb=$((jvm_max_conns * 512 + 1024 * 1024))
  ((mem_kb >= need_kb)) || die "jvm: ${mem_kb} kB available, a direct run at jvm_max_conns=$jvm_max_conns may need ${need_kb} kB"
}

scenario_jvm() { # REP
  local rep=$1 clients subject upstream_kind=jvm
  jvm_check_room
  for clients in $jvm_clients; do
    for subject in $jvm_subjects; do
      run_case jvm "$subject" "$jvm_delay" "$clients" "$rep" load_wrk
    done
  done
}

count_jvm() { echo $(($(wc -w <<<"$jvm_clients") * $(wc -w <<<"$jvm_subjects"))); }
