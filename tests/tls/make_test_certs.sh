#!/usr/bin/env bash
# Makes throwaway certificates for the TLS tests in $1: two CAs (ca, ca2), a server
# certificate from each (localhost, 127.0.0.1), and client certificates from ca
# (client-a: CN worker-a.example) and ca2 (client-x). Nothing here is secret.
set -euo pipefail
dir="$1"
mkdir -p "$dir"
cd "$dir"
ossl() { openssl "$@" 2>/dev/null; }
for ca in ca ca2; do
  ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=kvtier test $ca" -keyout "$ca.key" -out "$ca.pem"
done
issue() {  # name ca subject san
  ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$3" \
    -keyout "$1.key" -out "$1.csr"
  printf 'subjectAltName=%s\n' "$4" > "$1.ext"
  ossl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem"
}
issue server ca "/CN=localhost" "DNS:localhost,IP:127.0.0.1"
issue server2 ca2 "/CN=localhost" "DNS:localhost,IP:127.0.0.1"
issue client-a ca "/CN=worker-a.example" "DNS:worker-a.example"
issue client-x ca2 "/CN=worker-a.example" "DNS:worker-a.example"
