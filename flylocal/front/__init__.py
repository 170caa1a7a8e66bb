"""The front-ends: the command line (chat, generate, models, doctor), bench and serve. They turn
requests into sessions and render what the engine yields; none decodes anything itself."""
