# Install rules and package config (filled in by the packaging work).
