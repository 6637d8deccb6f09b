"""The speculation benchmarks' prompts, by class (chat, code, grounded): what
eval_speculative_identity.py, bench_speculative.py and eval_draft_head.py ask, and what no draft
head may be trained on."""

CHAT = [
    "What is the capital of France? Tell me a little about it.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "What are the benefits of regular exercise?",
    "Explain what a black hole is to a ten-year-old.",
    "How do I make a good cup of tea?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Why do leaves change colour in autumn?",
    "How can I improve my public speaking?",
    "What is photosynthesis?",
    "Tell me a short story about a lost dog who finds its way home.",
    "What are some good habits for learning a new language?",
    "Explain how vaccines work.",
    "What is the tallest mountain in the world and how was it measured?",
    "Write a friendly email inviting my team to a picnic on Friday.",
]

CODE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a JavaScript function that sums an array of numbers.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a Python function that counts the words in a text file.",
    "Write a bash script that prints the size of every file in a directory.",
    "Write a Python function to reverse a linked list.",
    "Write a C function that computes the factorial of a number.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Write a Python function that checks whether a number is prime.",
    "Write HTML for a simple login form with a username and a password field.",
    "Write a Python function that converts Celsius to Fahrenheit and back.",
    "Write a Python script that reads a CSV file and prints the average of a column.",
    "Write a Java method that finds the largest element in an array.",
    "Write a Python function that implements binary search.",
]

PASSAGES = [
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans about "
    "seven million square kilometres, of which five and a half million are covered by rainforest. "
    "The region includes territory belonging to nine nations. Most of the forest lies in Brazil, "
    "with 60 percent of the rainforest, followed by Peru with 13 percent and Colombia with 10 "
    "percent. The forest holds an estimated 390 billion trees divided into 16,000 species, and it "
    "plays a large part in the global carbon cycle. Deforestation, mostly for cattle ranching and "
    "soy farming, has removed about 17 percent of the forest in the last fifty years.",
    "The printing press was developed by Johannes Gutenberg in Mainz around 1440. It combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. "
    "Before it, books were copied by hand, which made them rare and expensive. Within fifty years "
    "printing presses were operating in more than two hundred European cities, and they had "
    "produced over twenty million volumes. Cheaper books spread literacy, helped the Reformation "
    "and the scientific revolution, and standardised spelling in many languages.",
    "Honey bees live in colonies of up to sixty thousand workers, a single queen and a few hundred "
    "drones. Workers are female and change jobs as they age: young bees clean cells and feed "
    "larvae, middle-aged bees build comb and guard the entrance, and the oldest bees forage for "
    "nectar and pollen. A forager tells her sisters where food is with the waggle dance, whose "
    "angle gives the direction relative to the sun and whose length gives the distance. A colony "
    "can make more than twenty kilograms of surplus honey in a good year.",
    "The Great Fire of London began on Sunday 2 September 1666 in a bakery on Pudding Lane. Fanned "
    "by a strong east wind, it burned for four days and destroyed about 13,200 houses, 87 parish "
    "churches and St Paul's Cathedral. Around 70,000 of the city's 80,000 inhabitants lost their "
    "homes, although the recorded death toll was small. Afterwards the city was rebuilt with brick "
    "and stone instead of timber, streets were widened, and Christopher Wren designed a new St "
    "Paul's Cathedral, completed in 1711.",
    "Lithium-ion batteries store energy by moving lithium ions between a graphite anode and a metal "
    "oxide cathode through an electrolyte. When the battery charges, ions move into the anode; when "
    "it discharges, they flow back and electrons travel through the external circuit, powering the "
    "device. These batteries have a high energy density and little memory effect, which is why they "
    "are used in phones, laptops and electric cars. Their capacity fades with every cycle, faster "
    "at high temperatures, and damaged cells can overheat and catch fire.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891 to study physics and "
    "mathematics at the Sorbonne. With her husband Pierre she discovered two new elements, polonium "
    "and radium, and she coined the term radioactivity. In 1903 she shared the Nobel Prize in "
    "Physics with Pierre and Henri Becquerel, and in 1911 she won the Nobel Prize in Chemistry "
    "alone, becoming the first person to win two Nobel Prizes. During the First World War she "
    "organised mobile X-ray units that treated more than a million soldiers.",
    "The human heart beats about one hundred thousand times a day and pumps roughly seven thousand "
    "litres of blood. It has four chambers: two atria that receive blood and two ventricles that "
    "pump it out. The right side sends blood to the lungs to pick up oxygen, and the left side "
    "pumps oxygen-rich blood to the rest of the body. Valves between the chambers keep the blood "
    "flowing in one direction. The heartbeat starts in the sinoatrial node, a small group of cells "
    "that acts as a natural pacemaker.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, rising 5,895 metres above sea "
    "level. It is a dormant volcano with three cones: Kibo, Mawenzi and Shira. Climbers pass "
    "through five climate zones, from cultivated land and rainforest through heath and alpine "
    "desert to the arctic summit. Most routes take five to nine days, and the main danger is "
    "altitude sickness rather than technical difficulty. The glaciers on the summit have shrunk by "
    "more than 80 percent since 1912.",
    "The city council voted on Tuesday to turn the old railway depot into a public library and "
    "community centre. The project will cost 12 million euros, of which the regional government "
    "pays half. Work starts in March and should finish within two years. The building will keep "
    "its brick facade and iron roof, and the new library will hold about 80,000 books, a cafe, a "
    "children's section and rooms that local groups can book for free. Opponents argued that the "
    "money should go to road repairs instead.",
]

TASKS = [
    "Summarise the following text in two or three sentences.\n\n{}",
    "List the key facts in the following text as bullet points.\n\n{}",
]
GROUNDED = [task.format(p) for p in PASSAGES for task in TASKS][:17]
CLASSES = {"chat": CHAT, "code": CODE, "grounded": GROUNDED}
