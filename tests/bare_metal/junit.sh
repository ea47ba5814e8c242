# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# JUnit cases for the shell tests of this folder (sourced). Each case is recorded as passed,
# failed or skipped; `junit_write SUITE` writes $XML_OUTPUT_FILE (Bazel's report; else
# nothing) and returns 1 when a case failed.
JUNIT_CASES=()
JUNIT_FAILED=0

junit_case() {  # name status(passed|failed|skipped) message
  local body=""
  case "$2" in
    failed)
      body="<failure message=\"$(junit_escape "$3")\"/>"
      JUNIT_FAILED=$((JUNIT_FAILED + 1)) ;;
    skipped) body="<skipped message=\"$(junit_escape "$3")\"/>" ;;
  esac
  JUNIT_CASES+=("<testcase classname=\"$JUNIT_CLASS\" name=\"$1\">$body</testcase>")
  echo "$2: $1${3:+: $3}"
}

junit_escape() {
  local s=${1//&/&amp;}
  s=${s//</&lt;}
  s=${s//>/&gt;}
  s=${s//\"/&quot;}
  printf '%s' "$s"
}

junit_write() {  # suite
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites><testsuite name=\"$1\" tests=\"${#JUNIT_CASES[@]}\" failures=\"$JUNIT_FAILED\">"
    printf '%s\n' "${JUNIT_CASES[@]}"
    echo '</testsuite></testsuites>'
  } >"${XML_OUTPUT_FILE:-/dev/null}"
  [[ $JUNIT_FAILED -eq 0 ]]
}
