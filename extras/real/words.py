"""The word lists the real-model prompts are filled from (extras/real/distill.py's general instructions and
extras/real/checks.py's checkable ones): one place, so neither imports the other."""
import data

TOPICS = """gravity, photosynthesis, a rainbow, the water cycle, electricity, a volcano, the moon, friendship,
exercise, sleep, recycling, the internet, a computer, music, money, a library, the weather, ocean tides, the
seasons, a battery, a map, a calendar, a thermometer, a bridge, an earthquake, the sun, clouds, a magnet, a
telescope, a vaccine, a river delta, a desert, a rainforest, democracy, a museum, a recipe, a budget, a
password, an email, a bicycle, a compass, a microscope, a solar panel, a windmill, a glacier, a coral reef,
honeybees, a heartbeat, breathing, a shadow""".replace("\n", " ").split(", ")
ACTIVITIES = """learning to cook, studying for an exam, saving money, staying focused, making new friends, running
a first race, planting a garden, writing an email, reading more books, sleeping better, learning a language,
keeping a room tidy, drinking more water, giving a short speech, starting a journal, caring for a cat, walking
a dog, packing for a trip, cooking rice, baking bread, painting a wall, learning to swim, riding a bicycle,
preparing for an interview, taking notes in class""".replace("\n", " ").split(", ")
PLACES = """kitchen, forest, school, hospital, garden, city park, beach, library, farm, train station, museum,
bakery, zoo, desert, office, classroom, supermarket, campsite, airport, castle""".replace("\n", " ").split(", ")
ADJECTIVES = sorted(data.OPPOSITES)
NOUNS = [w for w in data.WORDS if w not in {"useful", "vivid", "urban", "lucky", "quick", "jolly", "noble", "lunar"}]
A_NOUN = [("an " if w[0] in "aeiou" else "a ") + w for w in NOUNS]
A_PLACE = [("an " if w[0] in "aeiou" else "a ") + w for w in PLACES]
