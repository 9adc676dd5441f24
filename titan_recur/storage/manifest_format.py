"""The names of manifest.json's format, without its checksum library: storage/manifest.py writes and checks
manifests with them, and the HF export inlines this module into its modeling file, which checks an export's
files where xxhash may be missing."""

MANIFEST_NAME = "manifest.json"
CHECKSUM = "xxh3_128"
