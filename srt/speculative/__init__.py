"""Speculative decoding: n-gram drafts over a request's own tokens, verified exactly."""
