"""The one client stack: channels, cluster view, model references, the chunk-fetch engine,
pull and push, and the ``paramctl`` CLI."""
