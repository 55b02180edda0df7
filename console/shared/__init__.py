"""What the two desktop shells share: the tray agent (``agent.tray``) and the admin console.

- :mod:`~console.shared.loop_thread`: the one asyncio loop a shell runs its networking on, in a
  thread of its own, with a sync facade whose every wait has a timeout;
- :mod:`~console.shared.qt_async`: the bridge from that loop back to the GUI thread (queued
  calls and signals; Qt is never touched from the loop);
- :mod:`~console.shared.chat_model` and :mod:`~console.shared.chat_view`: the chat with the
  fleet's OpenAI API, a Qt-free model and its thin Qt window (the console's Chat page and the
  tray's "Chat" both open it), with its parts :mod:`~console.shared.transcript` and
  :mod:`~console.shared.chat_input`; Qt-free beside them: :mod:`~console.shared.markdown` (answers
  as rich text, a Copy link per code block), :mod:`~console.shared.conversations` (the chats kept
  on disk per user) and :mod:`~console.shared.fleet_line` (the line saying why the fleet cannot
  answer now).

Who may import it: anything in ``console`` and in ``agent``; it is the only part of the console
the agent may import. It imports nothing else of the console (nor of the agent), so the tray
never pulls in the console's pages or services. import-linter contracts in ``pyproject.toml``
hold both rules (``lint-imports``).
"""
