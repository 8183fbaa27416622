# The lowtail core modules that Ansible ships to hosts inside AnsiballZ payloads. Every other file here
# is a symlink to python/lowtail/: one implementation for the roles, the runtime and the validator.
