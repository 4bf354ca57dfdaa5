# Sourced by the GPU scripts: run SECONDS NAME COMMAND... runs COMMAND with a time limit, its output in
# $OUT/NAME.log, and prints the exit status and the log's last lines (TAIL, default 8).
run() {
    local limit=$1 name=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "   exit $? (limit ${limit} s)"
    tail -n "${TAIL:-8}" "$OUT/$name.log"
}
