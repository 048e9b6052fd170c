"""The HTTP process's side of a request: tokenizing, preparing, sending, detokenizing, checking."""
