# Sourced by the campaign scripts (campaign.sh, variants.sh, neighbourhood_gpus.sh): the pieces of a
# resumable device call they share.

# send_state_back STATE: with OUT set, the state goes back at exit as OUT/pxstate.tgz.part-* of at
# most 15 MiB each (a returned file over 16 MiB is dropped); unpack with
# `cat FILES_AT/pxstate.tgz.part-* | tar xzf - -C REPO`.
send_state_back() {
    [ -n "${OUT:-}" ] || return 0
    _state_dir=$1
    trap 'tar czf - -C "$(dirname "$_state_dir")" "$(basename "$_state_dir")" | split -b 15M - "$OUT/pxstate.tgz.part-"' EXIT
}

# wait_runs PID...: wait for runs started side by side; returns an error code if any failed, else 75
# if any has time left to run (campaign.sh's "time is up"), else 0.
wait_runs() {
    local rc=0 p r
    for p in "$@"; do
        wait "$p"; r=$?
        if [ "$r" -ne 0 ] && [ "$r" -ne 75 ]; then rc=$r; elif [ "$r" -eq 75 ] && [ "$rc" -eq 0 ]; then rc=75; fi
    done
    return $rc
}
