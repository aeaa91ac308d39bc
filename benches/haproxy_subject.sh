# The HAProxy that benches/instructions.sh and benches/syscalls.sh measure floodgate against, for them to source:
# one thread, any idle upstream connection for any client, a cap of CAP on the one server.
#
#   write_haproxy_cfg FILE SUBJECT LISTEN_PORT UPSTREAM_PORT CAP
#
# SUBJECT `haproxy` is HAProxy as configured above; `haproxy-headers` also does the header work floodgate does by
# default (haproxy_headers.cfg beside this file).
write_haproxy_cfg() {
  local headers=""
  [ "$2" = haproxy-headers ] && headers=$(cat "$(dirname "${BASH_SOURCE[0]}")/haproxy_headers.cfg")
  cat >"$1" <<CFG
global
    nbthread 1
    maxconn 5000
defaults
    mode http
    maxconn 5000
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout queue 2s
    http-reuse always
frontend fe
    bind 127.0.0.1:$3
    default_backend be_app
$headers
backend be_app
    server app 127.0.0.1:$4 maxconn $5
CFG
}
