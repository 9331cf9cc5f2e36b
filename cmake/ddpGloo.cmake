# gloo backend target (filled in by the gloo work)
