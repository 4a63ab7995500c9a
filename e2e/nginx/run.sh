#!/usr/bin/env bash
# nginx in front of two Keel instances, with the config of docs/operations.md ("Behind nginx") as it
# is written there: SSE unbuffered, a WebSocket upgrade, a reconnect with Last-Event-ID that lands
# on the other instance and gets no gap and no duplicate (e2e/nginx/check.py).
#
# Needs KEEL_TEST_POSTGRES_URL and KEEL_TEST_REDIS_URL (the instances share PostgreSQL and Redis, as
# in production), psql (a schema of its own, dropped afterwards) and python3. Uses `nginx` from the
# PATH, or $NGINX, or else Debian's `nginx` package, fetched with `apt-get download` and unpacked
# under /var/tmp/keel-nginx (not installed: no service is started, nothing outside that directory
# changes; `apt-get update` first when the package lists lack it and we are root).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/keel-target}"
: "${KEEL_TEST_POSTGRES_URL:?set KEEL_TEST_POSTGRES_URL (e.g. postgres://postgres@127.0.0.1:5432/test)}"
: "${KEEL_TEST_REDIS_URL:?set KEEL_TEST_REDIS_URL (e.g. redis://127.0.0.1:6379)}"

NGINX="${NGINX:-$(command -v nginx || true)}"
if [ -z "$NGINX" ]; then
  CACHE=/var/tmp/keel-nginx
  if [ ! -x "$CACHE/usr/sbin/nginx" ]; then
    echo "== fetching Debian's nginx package (apt-get download; unpacked into $CACHE)"
    mkdir -p "$CACHE/deb"
    if ! (cd "$CACHE/deb" && apt-get download nginx >/dev/null 2>&1); then
      [ "$(id -u)" = 0 ] || { echo "apt-get download nginx failed; run as root or install nginx" >&2; exit 1; }
      apt-get update -qq
      (cd "$CACHE/deb" && apt-get download nginx >/dev/null)
    fi
    dpkg -x "$(ls "$CACHE"/deb/nginx_*.deb | head -n 1)" "$CACHE"
  fi
  NGINX="$CACHE/usr/sbin/nginx"
fi
"$NGINX" -v

echo "== cargo build -p keel"
cargo build -q -p keel --locked
BIN="$CARGO_TARGET_DIR/debug/keel"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/keel-nginx.XXXXXX")
SCHEMA="keel_nginx_$(date +%s)_$$"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  psql -q "$KEEL_TEST_POSTGRES_URL" -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

psql -q -v ON_ERROR_STOP=1 "$KEEL_TEST_POSTGRES_URL" -c "CREATE SCHEMA $SCHEMA" >/dev/null
case "$KEEL_TEST_POSTGRES_URL" in *\?*) SEP='&' ;; *) SEP='?' ;; esac
DB="${KEEL_TEST_POSTGRES_URL}${SEP}options=-c%20search_path%3D${SCHEMA}"

# Two `keel demo` instances (OpsPilot's fleet is shared through the database), one after the other
# (the first seeds the fleet), each on a free port it prints (set in $URL; not run in a subshell, so
# that PIDS keeps each process for the cleanup).
start() {
  local name=$1
  env -u KEEL_LISTEN -u KEEL_DB -u KEEL_BUS RUST_LOG=warn NO_COLOR=1 "$BIN" demo --listen 127.0.0.1:0 --db "$DB" \
    --bus "$KEEL_TEST_REDIS_URL" --instance-id "$name" --data-dir "$WORK/$name" --lease-ttl 2s \
    --demo-delay-ms 30 --trusted-proxy 127.0.0.1 --rate-limit 0 --rate-limit-per-address 0 \
    >"$WORK/$name.out" 2>"$WORK/$name.log" &
  PIDS+=($!)
  local pid=$! deadline=$((SECONDS + 60)) url=""
  URL=""
  until [ -n "$url" ]; do
    url=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$WORK/$name.out" | head -n 1 || true)
    kill -0 "$pid" 2>/dev/null || { echo "keel $name exited:"; cat "$WORK/$name.log"; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "keel $name printed no address"; cat "$WORK/$name.log"; exit 1; }
    [ -n "$url" ] || sleep 0.2
  done
  until curl -sf "$url/readyz" >/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "keel $name is not ready"; cat "$WORK/$name.log"; exit 1; }
    sleep 0.2
  done
  URL=$url
}
start nginx-a
A=$URL
start nginx-b
B=$URL
echo "== instances: $A $B"

# The documented block, as written; only the two upstream addresses and the port are replaced.
awk '/<!-- nginx-tested -->/ {on=1; next} on && /^```nginx/ {inside=1; next} inside && /^```/ {exit} inside {print}' \
  docs/operations.md >"$WORK/keel.conf.doc"
# packaging/nginx-keel.conf (compose.yaml's) is the same block with compose's instance names.
sed -e 's/server keel-a:8080;/server 10.0.0.11:8080;/' -e 's/server keel-b:8080;/server 10.0.0.12:8080;/' \
  packaging/nginx-keel.conf | grep -v '^#' >"$WORK/packaged.conf"
if ! grep -v '^#' "$WORK/keel.conf.doc" | diff -u - "$WORK/packaged.conf"; then
  echo "packaging/nginx-keel.conf differs from docs/operations.md's nginx block (above)" >&2
  exit 1
fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 - "$WORK/keel.conf.doc" "$WORK/keel.conf" "${A#http://}" "${B#http://}" "$PORT" <<'PY'
import sys
src, dst, a, b, port = sys.argv[1:]
text = open(src).read()
for old, new in (("server 10.0.0.11:8080;", f"server {a};"), ("server 10.0.0.12:8080;", f"server {b};"),
                 ("listen 80;", f"listen 127.0.0.1:{port};")):
    if text.count(old) != 1:
        sys.exit(f"docs/operations.md's nginx block no longer has exactly one `{old}`")
    text = text.replace(old, new)
open(dst, "w").write(text)
PY

# nginx's own frame around the block (what /etc/nginx/nginx.conf gives it), unprivileged, in $WORK;
# the access log names each request's upstream, which is how the check tells the instances apart.
mkdir -p "$WORK/nginx"
cat >"$WORK/nginx.conf" <<CONF
daemon off;
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 256; }
http {
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  log_format upstream '\$request_method \$request_uri \$status \$upstream_addr';
  access_log $WORK/nginx/access.log upstream;
  include $WORK/keel.conf;
}
CONF
"$NGINX" -t -p "$WORK/nginx" -c "$WORK/nginx.conf" -e "$WORK/nginx/error.log"
"$NGINX" -p "$WORK/nginx" -c "$WORK/nginx.conf" -e "$WORK/nginx/error.log" &
PIDS+=($!)
deadline=$((SECONDS + 20))
until curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] || { echo "nginx did not answer"; cat "$WORK/nginx/error.log"; exit 1; }
  sleep 0.2
done
echo "== nginx on 127.0.0.1:$PORT with docs/operations.md's block"

status=0
python3 e2e/nginx/check.py --nginx "http://127.0.0.1:$PORT" --direct "$A" --instances "$A" "$B" \
  --access-log "$WORK/nginx/access.log" || status=$?
if [ "$status" != 0 ]; then
  echo "== nginx error log"; tail -n 40 "$WORK/nginx/error.log" || true
  echo "== access log"; tail -n 40 "$WORK/nginx/access.log" || true
  for n in nginx-a nginx-b; do echo "== keel $n (last 40 lines)"; tail -n 40 "$WORK/$n.log"; done
fi
exit "$status"
