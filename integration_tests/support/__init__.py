"""Test-only support: multi-process launcher and CPU shims. Never imported by het_plugin itself."""
