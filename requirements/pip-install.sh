# Sourced by the install scripts: `pip_install PIP ARGS...` runs `PIP install ARGS...` and keeps its
# output, except the two kinds of noise these installs make on purpose, which it counts instead:
#  - pip's "dependency resolver ... conflicts" blocks: the frameworks go in with --no-deps (their
#    CUDA dependency trees are left out), so pip lists what they would pull in; the tests check that
#    what they use imports;
#  - "WARNING: Location '...' is ignored": this machine's local package index lacks a folder.
# Any other line pip writes is printed as it is, and pip's exit code is the function's.
pip_install() {
  local pip="$1"
  shift
  local log rc=0
  log="$(mktemp)"
  "$pip" install "$@" 2>"$log" || rc=$?
  awk '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { block = 1; notes++; next }
    block && (/ requires / || /has requirement/ || /which is not installed/ || /but you have/ || /incompatible/) { notes++; next }
    { block = 0 }
    /^WARNING: Location .* is ignored: it is neither a file nor a directory/ { index_notes++; next }
    { print > "/dev/stderr" }
    END {
      if (notes > 0)
        printf "pip: %d dependency-resolver lines left out: expected, the frameworks are installed with --no-deps (see requirements/pip-install.sh)\n", notes > "/dev/stderr"
    }
  ' "$log"
  rm -f "$log"
  return "$rc"
}
