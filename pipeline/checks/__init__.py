"""Node checks: `promptr1 check` (`layout`: can the params run on the machines they describe, params only) and
`promptr1 doctor` (`doctor`: a new node's checks in order, with `doctor_environment` and `doctor_train`)."""
