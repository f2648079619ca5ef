"""Word pools the sim task families draw labels, words and list items from.

Changing a pool changes every generated task (and so the shipped suite files): regenerate them
with ``uv run python -m dart.env.sim`` after editing.
"""

from __future__ import annotations

BUTTON_LABELS = (
    "OK", "Cancel", "Next", "Back", "Save", "Delete", "Yes", "No", "Apply", "Close", "Open", "Help",
    "Retry", "Skip", "Done", "Edit", "Copy", "Print", "Share", "Send", "Undo", "Stop", "Start", "Load",
)  # fmt: skip

FORM_DISTRACTORS = ("Cancel", "Reset", "Clear", "Back")
"""Second buttons on forms; pressing one ends the episode unsubmitted."""

FIELD_LABELS = ("Name", "City", "Email", "Code", "Tag", "Title", "User", "Pet", "Color", "Word")

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "rocket", "garden", "silver",
    "pencil", "winter", "orange", "forest", "camera", "window", "bridge", "candle", "planet", "yellow",
    "kiwi", "moon", "fox", "owl", "jazz", "mint", "sand", "wolf", "rain", "gold",
    "paris", "delta", "omega", "pixel", "laser", "ocean", "maple", "cedar", "honey", "coral",
)  # fmt: skip
"""Words to type: lower case, 3 to 6 letters, so they fit a field at the smallest screen."""

CHECKBOX_LABELS = (
    "Red", "Blue", "Green", "Pink", "Gray", "Black", "White", "Cyan", "Lime", "Navy",
    "Cat", "Dog", "Bird", "Fish", "Frog", "Bear", "Duck", "Goat", "Lion", "Seal",
)  # fmt: skip

LIST_ITEMS = (
    "Apple", "Banana", "Cherry", "Grape", "Lemon", "Mango", "Melon", "Peach", "Pear", "Plum",
    "Berlin", "Cairo", "Dublin", "Lima", "Madrid", "Oslo", "Paris", "Rome", "Tokyo", "Vienna",
    "Amber", "Coral", "Ivory", "Jade", "Olive", "Ruby", "Sand", "Slate", "Teal", "Umber",
)  # fmt: skip
