"""dart.policy: what a DART policy sees and says (model families and writers, prompt formats, screen sizing, the
action grammar)."""

__version__ = "0.1.0"
