"""The llamaft operator: thin kopf handlers (`handlers`) over pure functions (`desired`, `observe`)."""
